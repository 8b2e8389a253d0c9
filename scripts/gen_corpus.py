"""One-off generator for kvreuse/data/corpus.txt (run once; the output file is committed).

Deterministic: a fixed random seed, word lists and templates. Mixes prose, dialogue, numbers,
dates, prices, code (Python, JSON, shell, SQL, HTML), markdown lists and some non-ASCII text so the
byte-level BPE tokenizer trained on it behaves like a real one.
"""

import random
import sys

rng = random.Random(20240611)

NAMES = ["Alice", "Bob", "Carol", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kofi",
         "Lena", "Marta", "Noah", "Olga", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Uma", "Victor",
         "Wen", "Ximena", "Yusuf", "Zoë", "Renée", "José", "François", "Søren", "Björn", "Chloé"]
PLACES = ["Paris", "Berlin", "Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Cairo", "Dublin",
          "Zürich", "São Paulo", "Kraków", "Reykjavík", "Montréal", "Málaga", "Bogotá", "Seoul", "Delhi",
          "Melbourne", "Chicago", "Boston", "the harbour", "the old library", "the mountain village",
          "the train station", "the research lab", "the market square", "the quiet café"]
ADJ = ["small", "large", "quiet", "noisy", "bright", "dark", "ancient", "modern", "careful", "quick",
       "slow", "curious", "patient", "tired", "happy", "strange", "simple", "complex", "warm", "cold",
       "red", "blue", "green", "golden", "silver", "heavy", "light", "narrow", "wide", "gentle",
       "efficient", "reliable", "fragile", "hidden", "famous", "local", "remote", "shared", "private"]
NOUNS = ["river", "garden", "machine", "letter", "window", "bridge", "engine", "report", "cache",
         "server", "request", "teacher", "student", "doctor", "farmer", "painter", "musician", "city",
         "forest", "kitchen", "notebook", "question", "answer", "problem", "solution", "model", "table",
         "memory", "network", "river bank", "storm", "island", "library", "computer", "program",
         "recipe", "journey", "festival", "experiment", "theory", "map", "clock", "lamp", "boat",
         "token", "sequence", "batch", "queue", "block", "prefix", "document", "conversation"]
VERBS_PAST = ["opened", "closed", "found", "lost", "built", "repaired", "painted", "wrote", "read",
              "measured", "counted", "sorted", "cached", "shared", "carried", "followed", "explained",
              "described", "tested", "improved", "cleaned", "watched", "visited", "crossed", "studied",
              "designed", "launched", "reviewed", "compared", "collected", "planted", "cooked"]
VERBS = ["open", "close", "find", "build", "repair", "paint", "write", "read", "measure", "count",
         "sort", "share", "carry", "follow", "explain", "describe", "test", "improve", "clean", "watch",
         "visit", "cross", "study", "design", "review", "compare", "collect", "plant", "cook", "reuse"]
ADV = ["slowly", "quickly", "carefully", "quietly", "suddenly", "eventually", "happily", "rarely",
       "often", "always", "never", "almost", "nearly", "together", "again", "already", "finally"]
TIMES = ["in the morning", "at noon", "late at night", "on Monday", "on Friday evening", "last week",
         "yesterday", "the next day", "after lunch", "before sunrise", "in 1998", "in 2019",
         "during the winter", "every spring", "at 7:30 a.m.", "at 18:45", "around midnight"]
CONNECT = ["However,", "Meanwhile,", "Later,", "Then", "Afterwards,", "In the end,", "Surprisingly,",
           "Of course,", "For example,", "In fact,", "As a result,", "Still,", "Nevertheless,"]
TOPICS = ["weather", "history", "cooking", "astronomy", "gardening", "music", "chess", "economics",
          "biology", "geometry", "databases", "compilers", "networking", "poetry", "travel", "sports"]
FOREIGN = ["café", "naïve", "résumé", "façade", "jalapeño", "über", "déjà vu", "piñata", "crème brûlée",
           "smörgåsbord", "Straße", "Ærø", "garçon", "coöperate", "fiancée", "œuvre", "mañana"]
UNICODE_SNIPPETS = ["東京は大きな都市です。", "日本語のテキスト", "你好，世界！", "Привет, мир!",
                    "Καλημέρα κόσμε", "α + β = γ", "안녕하세요", "مرحبا بالعالم", "שלום עולם",
                    "Temperature: 21°C", "Price: €12.50 or £10.99", "Arrows → ← ↑ ↓", "≤ ≥ ≠ ≈ ∞ √ π",
                    "Emoji: 🙂 🚀 🎉 ✅ ❤️ 👍🏽 🇯🇵", "“Quoted” text — with dashes… and ‘single’ quotes",
                    "Math: ∑ᵢ xᵢ² ≤ ∫₀¹ f(t) dt", "Ünïcödé wörds", "naïve café résumé"]


def pick(xs):
    return rng.choice(xs)


def sentence() -> str:
    kind = rng.randrange(9)
    if kind == 0:
        return f"The {pick(ADJ)} {pick(NOUNS)} {pick(VERBS_PAST)} the {pick(ADJ)} {pick(NOUNS)} {pick(TIMES)}."
    if kind == 1:
        return f"{pick(NAMES)} {pick(ADV)} {pick(VERBS_PAST)} a {pick(NOUNS)} near {pick(PLACES)}."
    if kind == 2:
        return (f"{pick(CONNECT)} {pick(NAMES)} and {pick(NAMES)} {pick(VERBS_PAST)} "
                f"{rng.randint(2, 999)} {pick(NOUNS)}s {pick(TIMES)}.")
    if kind == 3:
        return f"Why did the {pick(NOUNS)} {pick(VERBS)} the {pick(NOUNS)}? Nobody knew, but {pick(NAMES)} had a guess!"
    if kind == 4:
        return (f"\"I will {pick(VERBS)} it {pick(ADV)},\" said {pick(NAMES)}, "
                f"\"because the {pick(NOUNS)} is {pick(ADJ)}.\"")
    if kind == 5:
        return f"It's {pick(ADJ)}, isn't it? The {pick(NOUNS)} ({pick(ADJ)} and {pick(ADJ)}) can't {pick(VERBS)} itself."
    if kind == 6:
        pct = rng.randint(1, 99)
        return f"About {pct}% of the {pick(NOUNS)}s in {pick(PLACES)} were {pick(ADJ)}; the rest weren't."
    if kind == 7:
        return f"She ordered a {pick(FOREIGN)} in {pick(PLACES)} and paid ${rng.randint(1, 80)}.{rng.randint(0, 99):02d}."
    return f"{pick(NAMES)} wrote: {pick(UNICODE_SNIPPETS)}"


def paragraph() -> str:
    return " ".join(sentence() for _ in range(rng.randint(3, 7)))


def story() -> str:
    title = f"## The {pick(ADJ).title()} {pick(NOUNS).title()} of {pick(PLACES)}"
    return title + "\n\n" + "\n\n".join(paragraph() for _ in range(rng.randint(2, 4)))


def dialogue() -> str:
    a, b = rng.sample(NAMES, 2)
    lines = []
    for _ in range(rng.randint(3, 6)):
        lines.append(f"{a}: Can you {pick(VERBS)} the {pick(NOUNS)} {pick(TIMES)}?")
        lines.append(f"{b}: {pick(['Yes', 'No', 'Maybe', 'Sure', 'Not yet'])}, the {pick(NOUNS)} is still {pick(ADJ)}.")
    return "\n".join(lines)


def qa() -> str:
    x, y = rng.randint(0, 999), rng.randint(1, 99)
    op = pick(["+", "-", "*", "//", "%"])
    result = eval(f"{x} {op} {y}")
    topic = pick(TOPICS)
    return (f"Question: What is {x} {op} {y}?\nAnswer: {x} {op} {y} = {result}.\n"
            f"Question: Tell me one fact about {topic}.\nAnswer: {sentence()}")


def table() -> str:
    head = "| name | city | score | date |\n|------|------|------:|------|"
    rows = []
    for _ in range(rng.randint(3, 6)):
        rows.append(f"| {pick(NAMES)} | {pick(PLACES)} | {rng.uniform(0, 100):.2f} | "
                    f"{rng.randint(1990, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} |")
    return head + "\n" + "\n".join(rows)


def bullet_list() -> str:
    items = [f"- {pick(VERBS).capitalize()} the {pick(ADJ)} {pick(NOUNS)} ({rng.randint(1, 60)} min)"
             for _ in range(rng.randint(3, 7))]
    numbered = [f"{i}. {sentence()}" for i in range(1, rng.randint(3, 6))]
    return f"### Things to do {pick(TIMES)}\n\n" + "\n".join(items) + "\n\nSteps:\n" + "\n".join(numbered)


def python_code() -> str:
    fn = f"{pick(VERBS)}_{pick(NOUNS).replace(' ', '_')}"
    arg = pick(["items", "values", "tokens", "blocks", "rows", "requests"])
    n = rng.randint(2, 64)
    body_kind = rng.randrange(4)
    if body_kind == 0:
        body = (f"    total = 0\n    for i, item in enumerate({arg}):\n        if i % {n} == 0:\n"
                f"            total += item\n    return total\n")
    elif body_kind == 1:
        body = (f"    result: dict[str, int] = {{}}\n    for key in {arg}:\n"
                f"        result[key] = result.get(key, 0) + 1\n    return result\n")
    elif body_kind == 2:
        body = (f"    if not {arg}:\n        raise ValueError(\"{arg} must not be empty\")\n"
                f"    return sorted({arg}, key=lambda x: (-x[1], x[0]))[:{n}]\n")
    else:
        body = (f"    cache = {{}}\n    for x in {arg}:\n        h = hash(x) & 0x{rng.randint(0, 0xFFFF):04x}\n"
                f"        cache.setdefault(h, []).append(x)\n    return [len(v) for v in cache.values()]\n")
    doc = f'    """{pick(VERBS).capitalize()} the {pick(NOUNS)}s and return the {pick(ADJ)} ones."""\n'
    return f"```python\ndef {fn}({arg}: list, limit: int = {n}) -> list:\n{doc}{body}\n\nprint({fn}([1, 2, 3]))\n```"


def json_blob() -> str:
    name = pick(NAMES)
    return ("```json\n{\n"
            f"  \"id\": {rng.randint(1, 99999)},\n  \"name\": \"{name}\",\n"
            f"  \"city\": \"{pick(PLACES)}\",\n  \"active\": {pick(['true', 'false'])},\n"
            f"  \"score\": {rng.uniform(-5, 5):.3f},\n  \"tags\": [\"{pick(TOPICS)}\", \"{pick(TOPICS)}\"],\n"
            f"  \"created\": \"{rng.randint(2000, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T"
            f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z\"\n}}\n```")


def shell() -> str:
    cmds = [
        f"$ ls -la /home/{pick(NAMES).lower()}/projects",
        f"$ grep -rn \"{pick(NOUNS)}\" src/ | head -n {rng.randint(5, 50)}",
        f"$ python -m pytest tests/ -k \"{pick(VERBS)}\" -q",
        f"$ curl -s http://localhost:{rng.randint(1000, 9999)}/v1/completions -d '{{\"prompt\": \"hi\"}}'",
        f"$ export CACHE_SIZE={rng.randint(1, 64)}GiB && ./run.sh --workers {rng.randint(1, 16)}",
        f"$ git log --oneline -n {rng.randint(3, 20)}",
        f"$ docker run --rm -p 8000:8000 image:{rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}",
        f"$ tar -xzf archive-{rng.randint(100, 999)}.tar.gz -C /tmp",
    ]
    return "```bash\n" + "\n".join(rng.sample(cmds, rng.randint(2, 4))) + "\n```"


def sql() -> str:
    t = pick(["users", "orders", "requests", "blocks", "events"])
    return (f"```sql\nSELECT id, name, COUNT(*) AS n\nFROM {t}\nWHERE created_at >= '{rng.randint(2015, 2025)}-01-01'\n"
            f"  AND score > {rng.randint(0, 100)}\nGROUP BY id, name\nORDER BY n DESC\nLIMIT {rng.randint(1, 100)};\n```")


def html() -> str:
    return (f"<div class=\"{pick(ADJ)}-{pick(NOUNS).replace(' ', '-')}\">\n"
            f"  <h1>{pick(ADJ).title()} {pick(NOUNS)}</h1>\n  <p>{sentence()}</p>\n"
            f"  <a href=\"https://example.com/{pick(TOPICS)}?page={rng.randint(1, 20)}&amp;sort=asc\">more</a>\n</div>")


def numbers() -> str:
    parts = [
        f"Version {rng.randint(0, 9)}.{rng.randint(0, 30)}.{rng.randint(0, 99)} was released on "
        f"{rng.randint(1, 28)}/{rng.randint(1, 12)}/{rng.randint(1990, 2025)}.",
        f"The total was {rng.randint(1000, 9999999):,} units, up {rng.uniform(0, 50):.1f}% from last year.",
        f"Call +{rng.randint(1, 99)} {rng.randint(100, 999)} {rng.randint(100, 999)} {rng.randint(1000, 9999)} before {rng.randint(1, 12)} p.m.",
        f"Coordinates: {rng.uniform(-90, 90):.4f}, {rng.uniform(-180, 180):.4f}.",
        f"The ratio is {rng.randint(1, 9)}:{rng.randint(1, 9)} and pi is about 3.14159.",
        f"Hex 0x{rng.randint(0, 2**32):08X} equals {rng.randint(0, 2**32)} in some other base.",
        f"Latency p50={rng.randint(1, 99)}ms p99={rng.randint(100, 999)}ms throughput={rng.randint(10, 5000)} tok/s.",
    ]
    return " ".join(rng.sample(parts, rng.randint(2, 4)))


def chat_log() -> str:
    return (f"<user> {pick(['Hi', 'Hello', 'Hey'])}! Could you explain {pick(TOPICS)} in simple words?\n"
            f"<assistant> Sure. {paragraph()}\n<user> Thanks. And what about {pick(TOPICS)}?\n"
            f"<assistant> {paragraph()}")


def unicode_block() -> str:
    return "\n".join(rng.sample(UNICODE_SNIPPETS, rng.randint(2, 5)))


GENERATORS = [(story, 6), (dialogue, 3), (qa, 3), (table, 1), (bullet_list, 2), (python_code, 3),
              (json_blob, 2), (shell, 2), (sql, 1), (html, 1), (numbers, 3), (chat_log, 2),
              (unicode_block, 1)]


def main() -> None:
    target = int(sys.argv[2]) if len(sys.argv) > 2 else 220_000
    funcs = [f for f, w in GENERATORS for _ in range(w)]
    pieces: list[str] = []
    size = 0
    while size < target:
        piece = rng.choice(funcs)()
        pieces.append(piece)
        size += len(piece.encode("utf-8")) + 2
    with open(sys.argv[1], "w", encoding="utf-8", newline="\n") as f:
        f.write("\n\n".join(pieces) + "\n")


if __name__ == "__main__":
    main()
