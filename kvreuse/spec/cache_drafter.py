"""CacheDrafter: draft the next tokens by copying text the engine has already seen, in the request's namespace.

What a request will generate is often already written: an edit returns the function it was shown, an agent's
tool arguments quote the last tool result, a RAG answer quotes its passage, a chat turn restates the last. The
drafter finds the longest run of the sequence's last tokens (``prompt_lookup_min`` to ``prompt_lookup_max``)
that occurred before, in two places:

- the request's own prompt and output (vLLM's ``ngram`` prompt lookup reads only these);
- the namespace's store: the tokens of this namespace's finished sequences, each stored once past the prefix it
  shares with a stored one (as the radix tree stores a shared prefix once). It holds what the tree cached for the
  namespace and the outputs that followed, and outlives the pool's evictions within its own budget:
  ``namespace_tokens`` for all namespaces together, the least recently used namespace's oldest sequences first
  out (about 150-230 bytes a token with its index: 128Ki tokens, the default, take at most about 30 MB).

The namespace is the blocks' (``cache.hashing.namespace_key``: cache salt, adapter, model, EAGLE draft), so a
request drafts only from its own tenant's, adapter's and model's text: a draft from another namespace would let a
client time what others wrote (an accepted draft makes a step return more tokens).

The occurrences with the longest match vote for the continuation: at each depth the most frequent next token
is taken, with ``f`` its share of the occurrences still agreeing. ``Draft.confidence`` holds each token's ``f``;
the caller multiplies by the acceptance the request has seen (``AcceptanceRate``) and keeps a token while the
expected accepted tokens it adds pay for its verification row (``DraftCost`` in spec/draft_cost.py). Nothing
matches: nothing is proposed. When the occurrences branch, the chain follows the majority. A token tree of several
branches is not built: measured on the four workloads of benchmarks/bench_cache_drafts.py, even a tree that knew
the answer yields at most 9% more tokens a step than this chain, and a verification row costs a fifth to a third of
a one-row step on a CPU (benchmarks/bench_draft_trees.py; docs/benchmarks.md, "Token trees").

Pure Python, no torch: a lookup is a dict access and at most ``MAX_CANDIDATES`` backward comparisons per source.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

# Occurrences of the lookup key remembered per source (the latest ones: recent text repeats more).
MAX_CANDIDATES = 32
# Namespaces with a store at once; the least recently used goes beyond it.
MAX_NAMESPACES = 256
# The store's prefix sharing works on runs of this many tokens (the pool's block size by default).
SHARE_RUN = 16


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)  # each token's share of the occurrences voting for it
    match_len: int = 0  # tokens of the sequence's end that matched
    source: str = ""  # "request" | "namespace"


class TokenIndex:
    """Token sequences and, for each run of ``key_len`` tokens, where its latest occurrences end.

    Kept small, since a store holds many tokens: a run's key is its hash and its occurrences one packed int each
    (``sequence id << 32 | end``) in a list; a hash collision costs a comparison, never a wrong draft (the run's
    tokens are checked)."""

    def __init__(self, key_len: int) -> None:
        self.key_len = key_len
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, least recently used first
        self.index: dict[int, list[int]] = {}
        self.indexed: dict[int, int] = {}  # id -> tokens of it indexed so far
        self.num_tokens = 0
        self._next_id = 0

    def add(self, tokens: list[int]) -> int:
        sequence_id = self._next_id
        self._next_id += 1
        self.sequences[sequence_id] = tokens
        self.indexed[sequence_id] = 0
        self.extend(sequence_id)
        return sequence_id

    def extend(self, sequence_id: int) -> None:
        """Index the tokens appended to sequence ``sequence_id`` since the last call."""
        tokens = self.sequences[sequence_id]
        start = self.indexed[sequence_id]
        key_len = self.key_len
        index = self.index
        packed = sequence_id << 32
        for end in range(max(start, key_len), len(tokens) + 1):
            key = hash(tuple(tokens[end - key_len:end]))
            entries = index.get(key)
            if entries is None:
                index[key] = [packed | end]
                continue
            entries.append(packed | end)
            if len(entries) > 2 * MAX_CANDIDATES:
                del entries[:-MAX_CANDIDATES]
        self.num_tokens += len(tokens) - start
        self.indexed[sequence_id] = len(tokens)

    def remove(self, sequence_id: int) -> None:
        tokens = self.sequences.pop(sequence_id)
        self.indexed.pop(sequence_id)
        self.num_tokens -= len(tokens)
        for end in range(self.key_len, len(tokens) + 1):
            key = hash(tuple(tokens[end - self.key_len:end]))
            entries = self.index.get(key)
            if entries is None:
                continue
            kept = [entry for entry in entries if entry >> 32 != sequence_id]
            if kept:
                self.index[key] = kept
            else:
                del self.index[key]

    def candidates(self, query: Sequence[int], max_len: int) -> tuple[int, list[tuple[list[int], int]]]:
        """The longest match (at least ``key_len``, at most ``max_len`` tokens) of the end of ``query`` that is
        followed by at least one token, and every occurrence of that length as (tokens, continuation start)."""
        key_len = self.key_len
        if len(query) < key_len:
            return 0, []
        tail = list(query[-key_len:])
        entries = self.index.get(hash(tuple(tail)))
        if not entries:
            return 0, []
        best = 0
        found: list[tuple[list[int], int]] = []
        for entry in entries[-MAX_CANDIDATES:][::-1]:
            tokens = self.sequences.get(entry >> 32)
            end = entry & 0xFFFFFFFF
            if tokens is None or end >= len(tokens) or tokens[end - key_len:end] != tail:
                continue  # the query's own end, a sequence that ends there, or another run with the same hash
            length = key_len
            limit = min(max_len, end, len(query))
            while length < limit and tokens[end - length - 1] == query[-length - 1]:
                length += 1
            if length > best:
                best, found = length, [(tokens, end)]
            elif length == best:
                found.append((tokens, end))
        return best, found


class NamespaceStore:
    """One namespace's finished sequences, least recently used first, within ``budget`` tokens."""

    def __init__(self, key_len: int, budget: int) -> None:
        self.tokens = TokenIndex(key_len)
        self.budget = budget
        self._runs: dict[int, int] = {}  # chained hash of a sequence's first runs -> the sequence holding them
        self._owned: dict[int, list[int]] = {}  # sequence -> the run hashes it introduced

    def add(self, tokens: Sequence[int], overlap: int) -> None:
        """Store ``tokens`` past the prefix a stored sequence already holds (keeping ``overlap`` tokens before
        it, so a match across the boundary is found)."""
        shared = 0
        chained = 0
        hashes: list[int] = []
        for start in range(0, len(tokens) - SHARE_RUN + 1, SHARE_RUN):
            chained = hash((chained, tuple(tokens[start:start + SHARE_RUN])))
            owner = self._runs.get(chained)
            if owner is not None and owner in self.tokens.sequences and not hashes:
                self.tokens.sequences.move_to_end(owner)  # its prefix is in use again
                shared = start + SHARE_RUN
            else:
                hashes.append(chained)
        rest = list(tokens[max(0, shared - overlap):])
        if len(rest) <= self.tokens.key_len:
            return
        sequence_id = self.tokens.add(rest)
        for chained in hashes:
            self._runs[chained] = sequence_id
        self._owned[sequence_id] = hashes
        while self.tokens.num_tokens > self.budget and len(self.tokens.sequences) > 1:
            self.evict_oldest()

    def evict_oldest(self) -> int:
        """Drop the least recently used sequence; returns the tokens freed."""
        oldest = next(iter(self.tokens.sequences))
        before = self.tokens.num_tokens
        self.tokens.remove(oldest)
        for chained in self._owned.pop(oldest, []):
            if self._runs.get(chained) == oldest:
                del self._runs[chained]
        return before - self.tokens.num_tokens


class CacheDrafter:
    """Drafts for the engine's decoding sequences (see the module doc): ``propose`` for a sequence's next step
    (indexing its tokens as they grow), ``finish`` when it ends (its tokens go to its namespace's store)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, namespace_tokens: int) -> None:
        self.min_len = prompt_lookup_min
        self.max_len = prompt_lookup_max
        self.namespace_tokens = namespace_tokens
        self._own: dict[int, tuple[TokenIndex, int]] = {}  # sequence key -> its own tokens' index, the id in it
        self._stores: OrderedDict[str | None, NamespaceStore] = OrderedDict()

    def propose(self, key: int, namespace: str | None, tokens: list[int], max_tokens: int) -> Draft:
        """Up to ``max_tokens`` tokens to follow ``tokens`` (the sequence's prompt and output, which this call
        indexes as they grow: the same list object each step)."""
        best_len, found, source = self.occurrences(key, namespace, tokens)
        if best_len < self.min_len or not found or max_tokens <= 0:
            return Draft()
        draft = Draft(match_len=best_len, source=source)
        agreeing = found
        for depth in range(max_tokens):
            votes = Counter(seq[start + depth] for seq, start in agreeing if start + depth < len(seq))
            if not votes:
                break
            token, count = votes.most_common(1)[0]
            draft.token_ids.append(token)
            draft.confidence.append(count / len(agreeing))
            agreeing = [(seq, start) for seq, start in agreeing
                        if start + depth < len(seq) and seq[start + depth] == token]
        return draft

    def occurrences(self, key: int, namespace: str | None,
                    tokens: list[int]) -> tuple[int, list[tuple[list[int], int]], str]:
        """The longest match of the end of ``tokens`` in the sequence's own tokens (indexed here as they grow) and
        in its namespace's store, every occurrence of that length (both sources' when they tie) as (tokens,
        continuation start), and where the longest was found ("request" or "namespace")."""
        own = self._own.get(key)
        if own is None:
            index = TokenIndex(self.min_len)
            own = self._own[key] = (index, index.add(tokens))
        else:
            own[0].extend(own[1])
        best_len, found = own[0].candidates(tokens, self.max_len)
        source = "request"
        store = self._stores.get(namespace) if self.namespace_tokens else None
        if store is not None:
            self._stores.move_to_end(namespace)
            length, more = store.tokens.candidates(tokens, self.max_len)
            if length > best_len:
                best_len, found, source = length, more, "namespace"
            elif length == best_len and more:
                found = found + more
        return best_len, found, source

    def indexes(self, key: int, namespace: str | None) -> list[TokenIndex]:
        """The token indexes the sequence ``key`` drafts from: its own (once ``propose`` has seen it), then its
        namespace's store (if it has one)."""
        own = [self._own[key][0]] if key in self._own else []
        store = self._stores.get(namespace) if self.namespace_tokens else None
        return own + ([store.tokens] if store is not None else [])

    def finish(self, key: int, namespace: str | None, tokens: Sequence[int]) -> None:
        """The sequence ended: forget its own index and keep its tokens in its namespace's store."""
        self._own.pop(key, None)
        if not self.namespace_tokens or len(tokens) <= self.min_len:
            return
        store = self._stores.get(namespace)
        if store is None:
            store = self._stores[namespace] = NamespaceStore(self.min_len, self.namespace_tokens)
            while len(self._stores) > MAX_NAMESPACES:
                self._stores.popitem(last=False)
        else:
            self._stores.move_to_end(namespace)
        store.add(tokens, overlap=self.max_len)
        # All namespaces together within the budget: the least recently used namespace's oldest sequences go first.
        total = sum(each.tokens.num_tokens for each in self._stores.values())
        while total > self.namespace_tokens and self._stores:
            oldest_namespace, oldest = next(iter(self._stores.items()))
            total -= oldest.evict_oldest()
            if not oldest.tokens.sequences:
                del self._stores[oldest_namespace]

    def stored_tokens(self, namespace: str | None) -> int:
        store = self._stores.get(namespace)
        return store.tokens.num_tokens if store is not None else 0
