"""The ext_proc messages the endpoint picker sends Envoy, built in one place (gateway/epp/picker.py decides
what they say).

The protocol is the Gateway API Inference Extension's (docs/proposals/004-endpoint-picker-protocol): the picked
endpoints go in the `x-gateway-destination-endpoint` header and, with the same value, in the dynamic metadata
namespace `envoy.lb`; a request the picker answers itself (an error, /v1/models) is an ImmediateResponse. Bodies are
streamed back in chunks under 64 KiB, as Envoy's FULL_DUPLEX_STREAMED mode wants them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
CHUNK_BYTES = 62_000  # Envoy takes at most 64 KiB per streamed body message; GIE's pickers keep this margin too

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_options(headers: Mapping[str, str]) -> list[base_pb2.HeaderValueOption]:
    return [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")),
                                       append_action=_OVERWRITE) for k, v in headers.items()]


def request_headers_reply(destinations: Sequence[str], set_headers: Mapping[str, str],
                          remove: Iterable[str]) -> ext.ProcessingResponse:
    """The pick: header and `envoy.lb` metadata with the same comma-separated `ip:port` list (pick, then fallbacks)."""
    value = ",".join(destinations)
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: value}})
    mutation = ext.HeaderMutation(set_headers=header_options({DESTINATION_HEADER: value, **set_headers}),
                                  remove_headers=list(remove))
    return ext.ProcessingResponse(
        request_headers=ext.HeadersResponse(response=ext.CommonResponse(header_mutation=mutation)),
        dynamic_metadata=metadata)


def body_replies(body: bytes, request: bool, end_of_stream: bool = True) -> Iterator[ext.ProcessingResponse]:
    """`body` as streamed body mutations of at most CHUNK_BYTES each; the last carries `end_of_stream`."""
    view = memoryview(body)
    starts = range(0, len(body), CHUNK_BYTES) if body else range(1)
    last = starts[-1]
    for start in starts:
        chunk = ext.StreamedBodyResponse(body=bytes(view[start:start + CHUNK_BYTES]),
                                         end_of_stream=end_of_stream and start == last)
        common = ext.CommonResponse(body_mutation=ext.BodyMutation(streamed_response=chunk))
        yield (ext.ProcessingResponse(request_body=ext.BodyResponse(response=common)) if request
               else ext.ProcessingResponse(response_body=ext.BodyResponse(response=common)))


def response_body_reply(body: bytes, end_of_stream: bool) -> ext.ProcessingResponse:
    """One response chunk, passed on (as it came, or filtered)."""
    chunk = ext.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    return ext.ProcessingResponse(response_body=ext.BodyResponse(
        response=ext.CommonResponse(body_mutation=ext.BodyMutation(streamed_response=chunk))))


def response_headers_reply(set_headers: Mapping[str, str]) -> ext.ProcessingResponse:
    mutation = ext.HeaderMutation(set_headers=header_options(set_headers)) if set_headers else None
    return ext.ProcessingResponse(response_headers=ext.HeadersResponse(
        response=ext.CommonResponse(header_mutation=mutation)))


def trailers_reply(request: bool) -> ext.ProcessingResponse:
    return (ext.ProcessingResponse(request_trailers=ext.TrailersResponse()) if request
            else ext.ProcessingResponse(response_trailers=ext.TrailersResponse()))


def immediate(status: int, body: bytes, headers: Mapping[str, str]) -> ext.ProcessingResponse:
    """An answer from the picker itself: Envoy sends it to the client and never calls a replica."""
    return ext.ProcessingResponse(immediate_response=ext.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
        headers=ext.HeaderMutation(set_headers=header_options(headers)), body=body))


def header_pairs(headers: ext.HttpHeaders) -> list[tuple[bytes, bytes]]:
    """The message's headers as an ASGI scope holds them: lower-case names, raw values."""
    return [(h.key.lower().encode("latin-1"), h.raw_value or h.value.encode("latin-1"))
            for h in headers.headers.headers]


def metadata_value(request: ext.ProcessingRequest, namespace: str, key: str) -> Any:
    """A value Envoy forwarded in the request's metadata_context (filter metadata), or None."""
    context = request.metadata_context.filter_metadata
    if namespace not in context:
        return None
    fields = context[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    return None


def endpoint_list(value: Any) -> list[str] | None:
    """A subset hint or served endpoint as a list of `ip:port` (a list, or a comma-separated string)."""
    if value is None:
        return None
    items = value if isinstance(value, list) else str(value).split(",")
    return [item.strip() for item in items if item.strip()]
