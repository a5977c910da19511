"""`h2o-kv inspect`: was the fact still in the cache? One HTML page of what each policy's cache kept of a prompt.

run.py runs the prompt under each policy (the cache's `kept_map` at the end); picture.py draws the layers x
positions picture; page.py writes the page; cli.py is the subcommand.
"""
