{{/* One engine pod's spec; call with (dict "root" $ "engine" . "name" NAME "role" "single|leader|worker").
     A worker runs vLLM headless (its engines join the leader's; no API server of its own). */}}
{{- define "llm-serving.enginePodSpec" -}}
{{- $root := .root }}
{{- $engine := .engine }}
{{- $role := .role }}
terminationGracePeriodSeconds: {{ $root.Values.engineTerminationGraceSeconds }}
containers:
  - name: vllm
    image: {{ $engine.image }}
    {{- if eq $role "worker" }}
    # Data-parallel ranks of this node: after the leader's and the nodes before it.
    command:
      - /bin/sh
      - -c
      - exec vllm serve "$@" --data-parallel-start-rank $((LWS_WORKER_INDEX * {{ $engine.ranksPerNode }}))
      - vllm
    args:
      {{- toYaml $engine.workerArgs | nindent 6 }}
    {{- else }}
    args:
      {{- toYaml $engine.args | nindent 6 }}
      {{- if not (has "--shutdown-timeout" $engine.args) }}
      # vLLM's own drain: on SIGTERM in-flight requests get this long, inside the pod's grace.
      - --shutdown-timeout
      - {{ sub (int $root.Values.engineTerminationGraceSeconds) 10 | max 1 | quote }}
      {{- end }}
    {{- end }}
    env:
      {{- range $key, $value := $engine.env }}
      - name: {{ $key }}
        value: {{ $value | quote }}
      {{- end }}
      {{- with include "llm-serving.hfSecret" $root }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ . }}
            key: {{ $root.Values.huggingface.secretKey }}
            optional: true
      {{- end }}
    {{- if ne $role "worker" }}
    ports:
      - name: http
        containerPort: 8000
    {{- end }}
    {{- $resources := deepCopy $root.Values.engineResources }}
    {{- if gt (int $engine.gpus) 0 }}
    {{- $limits := merge (dict "nvidia.com/gpu" $engine.gpus) (get $resources "limits" | default dict) }}
    {{- $_ := set $resources "limits" $limits }}
    {{- end }}
    {{- with $resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- if eq $role "worker" }}
    # No API server here: ready when the leader's is, which answers /health only once the
    # engines of every node have joined. A lost node restarts the whole group (restartPolicy).
    readinessProbe:
      exec:
        command:
          - python3
          - -c
          - import os, urllib.request; urllib.request.urlopen("http://%s:8000/health" % os.environ["LWS_LEADER_ADDRESS"], timeout=5)
      periodSeconds: 10
      timeoutSeconds: 10
      failureThreshold: 3
    {{- else }}
    # Start-up covers a first download of the weights and their load: /health may take
    # `startupSeconds` to answer before the pod is restarted.
    startupProbe:
      httpGet:
        path: /health
        port: http
      periodSeconds: 10
      timeoutSeconds: 5
      failureThreshold: {{ div $engine.startupSeconds 10 }}
    readinessProbe:
      httpGet:
        path: /health
        port: http
      periodSeconds: 10
      timeoutSeconds: 5
      failureThreshold: 3
    livenessProbe:
      httpGet:
        path: /health
        port: http
      periodSeconds: 30
      timeoutSeconds: 10
      failureThreshold: 3
    {{- end }}
    volumeMounts:
      - name: shm
        mountPath: /dev/shm
      - name: model-cache
        mountPath: {{ $engine.env.HF_HOME }}
volumes:
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $root.Values.shm.sizeLimit }}
  - name: model-cache
    {{- if eq $root.Values.modelCache.type "persistentVolumeClaim" }}
    persistentVolumeClaim:
      claimName: {{ $root.Values.modelCache.existingClaim | default (printf "%s-cache" .name) }}
    {{- else }}
    emptyDir: {}
    {{- end }}
{{- with $root.Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := $root.Values.tolerations }}
{{- if gt (int $engine.gpus) 0 }}
{{- $tolerations = append $tolerations (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
