"""Stream migration: a stream whose replica fails after the first byte goes on, token for token, on another replica.

Three parts (the mechanism and its reasons: docs/stream-migration.md):

- `IdFilter` (id_filter.py), on every resumable stream's relay: keeps the generated ids the replica was asked for,
  gives the client the bytes it would have got without them, and notices a replica-side end (an abort, an error).
- `StallWatch` (stall.py): one ticker for all live streams; a stream silent longer than the stall timeout (or silent
  while its replica is ejected or fails its health probes) is closed, which turns it into a failure the relay then
  migrates.
- `Resumer` (resumer.py): on a failure, picks another replica (the coordinator's choice, the failed ones excluded),
  resumes through `/v1/completions` with the prompt's ids (POST /tokenize there) plus the ids whose effect the client
  has, sent through `Upstream.resume` as any attempt is, and relays the continuation as the same stream: chat's raw
  text goes through `policies.m3_stream` back into deltas. What the client has seen is kept exact after every leg.
"""

from gateway.migration.id_filter import RECENT_CHUNKS, IdFilter
from gateway.migration.resumer import Resumer
from gateway.migration.stall import StallWatch

__all__ = ["RECENT_CHUNKS", "IdFilter", "Resumer", "StallWatch"]
