"""The few text fields the gateway reads from an upload form (audio): `model`, `stream`.

The body is forwarded to the engine byte for byte, with the client's own content type (and so its
multipart boundary); the gateway only looks for the fields it routes by. Files are skipped, never
decoded. The body was read whole and bounded before this runs (limits.max_upload_bytes).
"""

from __future__ import annotations

from urllib.parse import parse_qsl

from server.gateway.errors import InvalidRequest

MAX_FIELD_BYTES = 4096  # a model name or a flag; longer text fields are not what we look for


def _boundary(content_type: str) -> bytes:
    for param in content_type.split(";")[1:]:
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary" and value:
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1]
            if value:
                return value.encode("latin-1")
    raise InvalidRequest("The multipart/form-data content type has no boundary.", code="invalid_form")


def _field_name(headers: bytes) -> tuple[str | None, bool]:
    """The part's form field name and whether it is a file, from its Content-Disposition."""
    for line in headers.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() != b"content-disposition":
            continue
        field: str | None = None
        is_file = False
        for param in value.decode("latin-1").split(";")[1:]:
            key, _, item = param.strip().partition("=")
            key = key.strip().lower()
            if key == "name":
                field = item.strip().strip('"')
            elif key in ("filename", "filename*"):
                is_file = True
        return field, is_file
    return None, False


def multipart_fields(body: bytes, content_type: str, wanted: frozenset[str]) -> dict[str, str]:
    """The text fields of a multipart/form-data body named in `wanted` (first occurrence each)."""
    delimiter = b"--" + _boundary(content_type)
    found: dict[str, str] = {}
    parts = body.split(delimiter)
    for part in parts[1:]:
        if part.startswith(b"--"):  # the closing delimiter
            break
        head, sep, content = part.partition(b"\r\n\r\n")
        if not sep:
            continue
        name, is_file = _field_name(head)
        if name is None or is_file or name not in wanted or name in found:
            continue
        if content.endswith(b"\r\n"):
            content = content[:-2]
        if len(content) > MAX_FIELD_BYTES:
            raise InvalidRequest(
                f"The form field `{name}` is longer than {MAX_FIELD_BYTES} bytes.", param=name, code="invalid_form"
            )
        found[name] = content.decode("utf-8", "replace")
    return found


def form_fields(body: bytes, content_type: str | None, wanted: frozenset[str]) -> dict[str, str]:
    """`wanted` text fields of a multipart/form-data or urlencoded body; 400 for any other type."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        return multipart_fields(body, content_type or "", wanted)
    if kind == "application/x-www-form-urlencoded":
        found: dict[str, str] = {}
        for key, value in parse_qsl(body.decode("latin-1"), keep_blank_values=True):
            if key in wanted and key not in found:
                found[key] = value
        return found
    raise InvalidRequest(
        f"This endpoint takes an upload: send it as multipart/form-data (got {kind or 'no content type'}).",
        code="invalid_content_type",
    )
