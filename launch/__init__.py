"""Processes that compose the gateway and the worker (which never import each other): `kvroute up` (a local
fleet), `kvroute worker` with its own OpenAI HTTP front door, and the README's demo."""
