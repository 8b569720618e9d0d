"""A reader that falls behind gets its pending chunks merged into one, carrying exactly what the
unmerged chunks carried: text and token ids in order, one logprob entry per token."""

from __future__ import annotations

import asyncio

from lmserve.server.engine.outputs import GenerationChunk, GenerationResult, TokenLogprob, merge_chunks
from lmserve.server.engine.request import FinishReason, Request, SamplingParams
from lmserve.server.engine.streams import ChunkStream
from test_engine_helpers import corpus_prompt, one_torch_thread, running, trained, wait_until  # noqa: F401 - fixtures by name


def test_merge_keeps_order_and_takes_the_finish_fields_from_the_later_chunk():
    a = GenerationChunk("r", "Hel", (5,), (TokenLogprob(5, -0.1, ((5, -0.1),)),))
    b = GenerationChunk("r", "lo", (6, 7), (TokenLogprob(6, -0.2), TokenLogprob(7, -0.3)), finish_reason=FinishReason.EOS)
    m = merge_chunks(a, b)
    assert (m.text, m.token_ids, [lp.token_id for lp in m.logprobs]) == ("Hello", (5, 6, 7), [5, 6, 7])
    assert m.logprobs[0].top == ((5, -0.1),) and m.finish_reason is FinishReason.EOS


async def test_a_stream_holds_one_merged_chunk_for_a_reader_that_is_away():
    stream = ChunkStream("r", asyncio.get_running_loop())
    for i in range(50):
        stream.put(GenerationChunk("r", str(i % 10), (i,)))
    chunk = await stream.get()
    assert chunk.token_ids == tuple(range(50)) and chunk.text == "".join(str(i % 10) for i in range(50))
    assert stream._pending is None  # nothing else is held


async def test_slow_reader_gets_fewer_chunks_with_the_same_text_ids_and_logprobs(trained):
    tok = trained.tokenizer
    params = SamplingParams(max_new_tokens=40, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)

    async def read(engine, away: bool):
        """Read the stream; `away`: after the first chunk, come back only once the engine has finished the
        request, so everything after it is pending at once (however fast either side runs)."""
        chunks, result = [], GenerationResult("x")
        async for chunk in engine.generate(Request(corpus_prompt(tok, "A red fox"), params)):
            chunks.append(chunk)
            result.add(chunk)
            if away and len(chunks) == 1:
                await wait_until(lambda: engine.stats().running == 0, "the request to finish in the engine")
        return chunks, result

    with running(trained) as engine:
        fast_chunks, fast = await read(engine, away=False)
        slow_chunks, slow = await read(engine, away=True)
    assert len(slow.token_ids) == len(fast.token_ids) == 40
    assert len(slow_chunks) <= 2  # what piled up while the reader was away came as one chunk
    assert any(len(c.token_ids) > 1 for c in slow_chunks)
    assert (slow.text, slow.token_ids) == (fast.text, fast.token_ids)
    assert [(lp.token_id, lp.logprob, lp.top) for lp in slow.logprobs] == [(lp.token_id, lp.logprob, lp.top) for lp in fast.logprobs]
    assert len(slow.logprobs) == 40
    assert slow_chunks[-1].finished and all(not c.finished for c in slow_chunks[:-1])
