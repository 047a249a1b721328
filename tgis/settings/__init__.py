"""Every setting of the launcher, the router and the shard, declared once (``catalogue.py``),
with what is built from the declarations: command-line options (``options.py``) and the
launcher's forwarding to its children (``forwarding.py``). No torch, no model code."""
