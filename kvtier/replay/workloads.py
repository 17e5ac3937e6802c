"""Seeded generators of Mooncake-format traces with shapes the conversation trace lacks, for
checking eviction policies on traffic no constant of theirs was chosen on.

Page ids are chained as an engine's prefix hash is: a page's id stands for its whole prefix, so
two requests share a page id only when everything before it is the same too. Generators describe
a request as a sequence of content labels (a prompt's 3rd page, a document's 7th...) and
`_PrefixIds` turns them into chained ids.

Each generator is a pure function of its arguments and its seed:

- `rag_requests`: retrieval-augmented questions over a shared document set: a system prompt,
  then the top-k documents in retrieval order (Zipf popular), then a private question;
- `agent_requests`: agent loops that re-read a growing context: each step resends the session's
  whole context plus the last tool call's output, steps a few requests apart;
- `short_chat_requests`: many short chats of one to three turns under a few small prompts: little
  reuse beyond the prompts, most pages never come back (a scan);
- `prompt_burst_requests`: bursts of one long system prompt: traffic moves from app to app, each
  burst one app's prompt plus short private suffixes, a few apps coming back later;
- `mixed_requests`: the four above interleaved, each in its own id space;
- `document_qa_requests`: questions over a fixed document set arriving as Poisson processes (one
  per document): when a document returns is memoryless, so its past gaps say little about its
  next one.

Verbs: `rag_requests`, `agent_requests`, `short_chat_requests`, `prompt_burst_requests`,
`mixed_requests`, `document_qa_requests`.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Hashable, Sequence

from kvtier.replay.replayer import DEFAULT_PAGE_TOKENS, TraceRequest

Label = Hashable  # what a page holds, without its prefix


class _PrefixIds:
    """Chained page ids: one id per (id of the page before, label)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Label], int] = {}

    def chain(self, labels: Sequence[Label]) -> list[int]:
        ids, parent = [], -1
        for label in labels:
            parent = self._ids.setdefault((parent, label), len(self._ids))
            ids.append(parent)
        return ids


def _zipf(rng: random.Random, count: int, alpha: float = 1.2) -> int:
    """A Zipf-like rank in [0, count): rank 0 the most popular."""
    return min(count - 1, int(rng.paretovariate(alpha)) - 1)


def _request(index: int, labels: list[Label], ids: _PrefixIds, rng: random.Random,
             page_tokens: int) -> TraceRequest:
    """A request whose full pages are `labels`, plus a partly filled last page of its own."""
    chain = ids.chain([*labels, ("tail", index)])
    input_length = page_tokens * len(labels) + rng.randint(1, page_tokens - 1)
    return TraceRequest(index * 300, input_length, 100, tuple(chain))


def _private(count: int, tag: object) -> list[Label]:
    return [("own", tag, page) for page in range(count)]


def rag_requests(num_requests: int, *, seed: int = 10, num_prompts: int = 3,
                 num_documents: int = 2000, top_k: int = 3,
                 document_pages: tuple[int, int] = (2, 12),
                 page_tokens: int = DEFAULT_PAGE_TOKENS) -> list[TraceRequest]:
    """Questions over a shared document set: a prompt (2-6 pages, Zipf over `num_prompts`),
    `top_k` distinct documents (Zipf over `num_documents` by popularity, `document_pages` pages
    each) in retrieval order, then 1-4 private pages."""
    rng = random.Random(seed)
    ids = _PrefixIds()
    prompt_pages = [rng.randint(2, 6) for _ in range(num_prompts)]
    sizes = [rng.randint(*document_pages) for _ in range(num_documents)]
    requests = []
    for index in range(num_requests):
        prompt = _zipf(rng, num_prompts)
        labels: list[Label] = [("prompt", prompt, p) for p in range(prompt_pages[prompt])]
        documents: list[int] = []
        while len(documents) < top_k:
            document = _zipf(rng, num_documents, 1.05)
            if document not in documents:
                documents.append(document)
        for document in documents:
            labels += [("doc", document, p) for p in range(sizes[document])]
        labels += _private(rng.randint(1, 4), index)
        requests.append(_request(index, labels, ids, rng, page_tokens))
    return requests


def agent_requests(num_requests: int, *, seed: int = 11, num_tools_prompts: int = 4,
                   steps: tuple[int, int] = (3, 30), step_gap_requests: float = 20.0,
                   new_session_share: float = 0.08,
                   page_tokens: int = DEFAULT_PAGE_TOKENS) -> list[TraceRequest]:
    """Agent sessions: a tools prompt (4-12 pages, Zipf over `num_tools_prompts`) and a task
    (1-3 pages), then `steps` steps, each resending the whole context plus the last step's output
    (1-6 pages), an exponential `step_gap_requests` requests after the step before. A new session
    starts with probability `new_session_share` per request, or when no step is due."""
    rng = random.Random(seed)
    ids = _PrefixIds()
    prompt_pages = [rng.randint(4, 12) for _ in range(num_tools_prompts)]
    due: list[tuple[int, float, int, list[Label], int]] = []  # (index, tie, session, ctx, left)
    requests = []
    num_sessions = 0
    for index in range(num_requests):
        if due and due[0][0] <= index and rng.random() >= new_session_share:
            _, _, session, context, left = heapq.heappop(due)
            context = context + _private(rng.randint(1, 6), (session, len(context)))
        else:
            session = num_sessions
            num_sessions += 1
            prompt = _zipf(rng, num_tools_prompts)
            context = [("tools", prompt, p) for p in range(prompt_pages[prompt])]
            context += _private(rng.randint(1, 3), (session, "task"))
            left = rng.randint(*steps)
        requests.append(_request(index, context, ids, rng, page_tokens))
        if left > 1:
            wait = max(1, int(rng.expovariate(1 / step_gap_requests)))
            heapq.heappush(due, (index + wait, rng.random(), session, context, left - 1))
    return requests


def short_chat_requests(num_requests: int, *, seed: int = 12, num_prompts: int = 200,
                        turn_share: float = 0.3, turn_gap_requests: float = 300.0,
                        page_tokens: int = DEFAULT_PAGE_TOKENS) -> list[TraceRequest]:
    """Short chats: a small prompt (1-4 pages, Zipf over `num_prompts`) and 1-8 private pages;
    a turn is followed by another with probability `turn_share` (so most chats are one turn),
    an exponential `turn_gap_requests` requests later, resending the chat plus 1-4 pages."""
    rng = random.Random(seed)
    ids = _PrefixIds()
    prompt_pages = [rng.randint(1, 4) for _ in range(num_prompts)]
    due: list[tuple[int, float, list[Label]]] = []
    requests = []
    for index in range(num_requests):
        if due and due[0][0] <= index:
            labels = heapq.heappop(due)[2] + _private(rng.randint(1, 4), index)
        else:
            prompt = _zipf(rng, num_prompts)
            labels = [("prompt", prompt, p) for p in range(prompt_pages[prompt])]
            labels += _private(rng.randint(1, 8), index)
        requests.append(_request(index, labels, ids, rng, page_tokens))
        if rng.random() < turn_share:
            wait = max(1, int(rng.expovariate(1 / turn_gap_requests)))
            heapq.heappush(due, (index + wait, rng.random(), labels))
    return requests


def prompt_burst_requests(num_requests: int, *, seed: int = 13, num_apps: int = 300,
                          burst_requests: tuple[int, int] = (20, 200),
                          background_share: float = 0.4,
                          page_tokens: int = DEFAULT_PAGE_TOKENS) -> list[TraceRequest]:
    """Bursts of one system prompt: a burst of `burst_requests` requests sends one app's long
    prompt (4-30 pages; the app Zipf over `num_apps`, so a few come back burst after burst) plus
    2-12 private pages; a `background_share` of requests are other apps' one-off calls."""
    rng = random.Random(seed)
    ids = _PrefixIds()
    prompt_pages = [rng.randint(4, 30) for _ in range(num_apps)]
    requests = []
    app, burst_left = 0, 0
    for index in range(num_requests):
        if not burst_left:
            app, burst_left = _zipf(rng, num_apps), rng.randint(*burst_requests)
        burst_left -= 1
        which = _zipf(rng, num_apps) if rng.random() < background_share else app
        labels: list[Label] = [("prompt", which, p) for p in range(prompt_pages[which])]
        labels += _private(rng.randint(2, 12), index)
        requests.append(_request(index, labels, ids, rng, page_tokens))
    return requests


def mixed_requests(num_requests: int, *, seed: int = 14,
                   page_tokens: int = DEFAULT_PAGE_TOKENS) -> list[TraceRequest]:
    """The other four generators' traffic interleaved at random (equal shares), each keeping its
    own order and id space."""
    rng = random.Random(seed)
    makers: list[Callable[..., list[TraceRequest]]] = [
        rag_requests, agent_requests, short_chat_requests, prompt_burst_requests]
    streams = [maker(num_requests, seed=seed * 10 + number, page_tokens=page_tokens)
               for number, maker in enumerate(makers)]
    positions = [0] * len(streams)
    id_offset = 1 + max(h for stream in streams for r in stream for h in r.hash_ids)
    requests = []
    for index in range(num_requests):
        number = rng.randrange(len(streams))
        source = streams[number][positions[number]]
        positions[number] += 1
        hash_ids = tuple(number * id_offset + h for h in source.hash_ids)
        requests.append(TraceRequest(index * 300, source.input_length, source.output_length,
                                     hash_ids))
    return requests


def document_qa_requests(num_requests: int, *, seed: int = 15, num_documents: int = 400,
                         document_pages: tuple[int, int] = (4, 40),
                         popularity_alpha: float = 0.8, num_prompts: int = 2,
                         mean_gap_ms: float = 200.0,
                         page_tokens: int = DEFAULT_PAGE_TOKENS) -> list[TraceRequest]:
    """Questions over a fixed set of `num_documents` documents (`document_pages` pages each):
    a prompt (1-3 pages, one of `num_prompts` at random), one document, then a private question
    (1-3 pages). Each document is asked about as a Poisson process of rate proportional to
    1 / rank^`popularity_alpha`; together they are one Poisson stream (exponential gaps of mean
    `mean_gap_ms`, coefficient of variation 1) whose requests pick their document independently
    by those rates, so the gaps between a document's returns are geometric: uncorrelated, and as
    likely long after a short one as after a long one."""
    rng = random.Random(seed)
    ids = _PrefixIds()
    prompt_pages = [rng.randint(1, 3) for _ in range(num_prompts)]
    sizes = [rng.randint(*document_pages) for _ in range(num_documents)]
    rates = [1.0 / (rank + 1) ** popularity_alpha for rank in range(num_documents)]
    rng.shuffle(rates)  # popularity unrelated to size
    documents = rng.choices(range(num_documents), weights=rates, k=num_requests)
    requests = []
    time_ms = 0.0
    for index, document in enumerate(documents):
        time_ms += rng.expovariate(1.0 / mean_gap_ms)
        prompt = rng.randrange(num_prompts)
        labels: list[Label] = [("prompt", prompt, p) for p in range(prompt_pages[prompt])]
        labels += [("doc", document, p) for p in range(sizes[document])]
        labels += _private(rng.randint(1, 3), index)
        chain = ids.chain([*labels, ("tail", index)])
        input_length = page_tokens * len(labels) + rng.randint(1, page_tokens - 1)
        requests.append(TraceRequest(int(time_ms), input_length, 100, tuple(chain)))
    return requests
