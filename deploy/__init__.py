"""Deployment: `launch` starts or joins Ray, places the worker actors and serves the HTTP API
(`pdserve up`, the demo and the tests use it); `scenarios/` holds the simulator's shipped trace;
the YAML files are cluster manifests for multi-node runs (see the README).
"""
