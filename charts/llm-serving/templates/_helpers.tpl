{{/* The release's name prefix for every object: the release name, or release-chart. */}}
{{- define "llm-serving.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* An engine's Deployment and Service name; call with (dict "root" $ "engine" .). */}}
{{- define "llm-serving.engineName" -}}
{{- printf "%s-%s" (include "llm-serving.fullname" .root) .engine | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The headless Service the gateway resolves for an engine: its Deployment's name, or for an engine
     over several nodes (a LeaderWorkerSet, whose own Service has its name) <name>-leader, the group
     leaders only; call with (dict "root" $ "engine" ENGINE-VALUES). */}}
{{- define "llm-serving.engineServiceName" -}}
{{- $name := include "llm-serving.engineName" (dict "root" .root "engine" .engine.name) }}
{{- if gt (int (.engine.nodes | default 1)) 1 -}}
{{- printf "%s-leader" ($name | trunc 56 | trimSuffix "-") -}}
{{- else -}}
{{- $name -}}
{{- end -}}
{{- end -}}

{{- define "llm-serving.gatewayName" -}}
{{- printf "%s-gateway" (include "llm-serving.fullname" .) -}}
{{- end -}}

{{- define "llm-serving.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "llm-serving.labels" -}}
{{ include "llm-serving.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* True when the cluster serves the Prometheus Operator's API. */}}
{{- define "llm-serving.hasPrometheusOperator" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}

{{/* The Hugging Face token Secret's name, or nothing when there is none. */}}
{{- define "llm-serving.hfSecret" -}}
{{- if .Values.huggingface.existingSecret -}}
{{- .Values.huggingface.existingSecret -}}
{{- else if .Values.huggingface.token -}}
{{- printf "%s-hf-token" (include "llm-serving.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The gateway API keys Secret's name, or nothing when the gateway is open. */}}
{{- define "llm-serving.apiKeysSecret" -}}
{{- if .Values.gateway.existingSecret -}}
{{- .Values.gateway.existingSecret -}}
{{- else if .Values.gateway.apiKeys -}}
{{- printf "%s-api-keys" (include "llm-serving.fullname" .) -}}
{{- end -}}
{{- end -}}
