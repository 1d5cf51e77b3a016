"""What the gateway shows of itself: Prometheus metrics (metrics.py), OpenTelemetry spans and the engines' own spans
(telemetry.py, engine_spans.py), and for the status page its latest requests (recent.py) and chart points
(history.py). It reads the request path's records and never steers a request."""
