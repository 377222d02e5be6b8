"""`kvpark bench`: the operator's benchmark, shipped with the clients.

It answers one question on the machine it runs on: how close do park and fetch come to what
Python moves over loopback TCP between two processes, at what CPU cost, and how fast is a late
fetch turned away. Modules, one concept each: `command` (options, one run, exit status),
`sections` (what is measured), `transports` (the table of transports, one row each),
`processes` (our own producer, CPU time), `rawtcp` (the baseline and its peer process),
`payload` (the bytes moved and their comparison), `report` (JSON and table). The experiments
behind docs/performance.md live outside the package, in the repository's `benchmarks/`.

Nothing is imported here: the raw-TCP peer runs as `python -m kvpark.client.bench.rawtcp`.
"""
