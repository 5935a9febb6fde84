"""The only package (with run.py) that knows Ray: actors wrapping the plain components."""
