"""The top of the import graph: the `kvroute` command line (cli.py) and the processes that compose the gateway
and the worker (which never import each other): `kvroute up` (a local fleet), `kvroute worker` with its own
OpenAI HTTP front door, and the README's demo. Beside them, the parts every launcher of processes shares,
which import neither gateway nor worker: the fleet launcher (fleet.py: children, readiness, stop; `free_port`)
and the Redis starter (redis_server.py), used by `kvroute bench --compare` / `--faults` and the tests too."""
