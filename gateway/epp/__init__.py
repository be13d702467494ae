"""kvroute as a Gateway API Inference Extension endpoint picker (docs/epp.md): Envoy's ext_proc protocol in
front of the gateway's request path (`gateway.epp.ext_proc`), served by `kvroute epp` (`gateway.epp.cli`)."""
