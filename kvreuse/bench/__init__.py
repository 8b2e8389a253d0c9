"""Benchmark suite: prefix-sharing workloads against any OpenAI-compatible server, reports and plots.

- ``workloads``: shared-prefix, multi-turn, rag, random, hot-prefix; exact token lengths.
- ``client``: async streaming load client (TTFT, ITL, TPOT, E2E, prompt / cached / output tokens).
- ``report`` / ``plot``: summaries, the printed table, JSON with every request, PNG plots.
- ``reference_server``: plain transformers with copied prompt caches behind the same API.
- ``compare``: kvreuse with caching on / off and transformers, one after another, same workload.
- ``options``: the workload and client options both commands share.
- ``cli``: ``kvreuse bench serve`` and ``kvreuse bench compare`` (``python -m kvreuse.bench``).
"""
