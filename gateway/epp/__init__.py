"""The Envoy door: `m3gate epp` serves the gateway's decisions to Envoy over ext_proc (picker.py), its messages built
in wire.py, its process in server.py, and envoy_config.py writes the Envoy bootstrap that puts it in front of the
pools."""
