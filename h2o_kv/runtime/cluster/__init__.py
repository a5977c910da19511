"""`h2o-kv serve --replicas N` on Ray Serve (the `cluster` extra): engine replicas (replica.py) behind a gateway
(gateway.py), routed by free KV memory and session (routing.py), launched by launch.py."""
