"""``text-generation-benchmark``: TGI's benchmark tool for this server.

It talks to a running shard directly, as TGI's does: the rank-0 shard's Unix socket
(``--master-shard-uds-path``, ``<shard-uds-path>-0``) for Info and Reset, and the step
channel it names for the Steps, through the router's own ``ShardClient``. For each batch
size it prefills ``batch`` prompts of ``--sequence-length`` tokens in one Step, then decodes
them for ``--decode-length`` tokens, ``--warmups`` untimed and ``--runs`` timed times, and
reports the latencies and throughputs TGI's tool reports. No torch is imported here: the
model runs in the shard process being measured.
"""
