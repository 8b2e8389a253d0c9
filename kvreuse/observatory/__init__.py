"""The cache observatory: what the prefix cache holds, who may see it, and why prompts miss it.

Torch-free on purpose (the offline ``kvreuse diagnose`` and the tests load it without a model):

- `scope`: which cache entries a caller may see (the tenant rule);
- `volatile`: dates, times, ids, whitespace and reordered blocks in the text around a divergence;
- `tools`: tool lists in prompts: which tool's definition changed (and where), came, went or moved;
- `drift`: the engine's bounded record of recent misses, grouped into a report with advice;
- `tree`: the prefix index's largest cached subtrees and how often each was reused;
- `diagnose`: the same analysis offline over a log of prompts (``kvreuse diagnose``).
"""
