"""The mixed workload's statistics: which inter-token gaps fall in a prefill window; when a long prompt
may be sent."""

import asyncio

import pytest

from lmserve.client.bench.mixed import MixedConfig, MixedResult, _streams_midway, split_gaps


def test_gaps_split_by_prefill_windows_and_never_across_requests():
    events = [(0, 0.0), (0, 1.0), (0, 2.0), (0, 5.0), (0, 6.0), (1, 6.5), (1, 7.0), (2, 0.5), (2, 3.5)]
    steady, during = split_gaps(sorted(events), windows=[(2.5, 4.0)], since=0.0)
    # request 0: 0-1, 1-2 steady; 2-5 overlaps the window; 5-6 steady. Request 1: 6.5-7 steady.
    # request 2: 0.5-3.5 overlaps. No gap joins request 0's 6.0 to request 1's 6.5.
    assert sorted(steady) == [0.5, 1.0, 1.0, 1.0] and sorted(during) == [3.0, 3.0]
    steady, during = split_gaps(sorted(events), windows=[(2.5, 4.0)], since=1.5)
    assert sorted(steady) == [0.5, 1.0] and sorted(during) == [3.0]  # gaps starting before `since` are left out


def test_summary_ratios():
    r = MixedResult(config={}, idle_ttft=[8.0, 10.0], load_ttft=[9.0, 12.0, 11.0], steady_itl=[0.1] * 50,
                    prefill_itl=[0.1] * 98 + [0.25, 0.3])
    s = r.summary()
    assert s["idle_ttft_median"] == 9.0 and s["load_ttft_median"] == 11.0
    assert s["ttft_load_over_idle"] == pytest.approx(11 / 9)
    assert s["itl_p99_during_prefill_over_steady_p50"] == pytest.approx(s["prefill_itl"]["p99"] / 0.1)


def test_config_is_validated():
    with pytest.raises(ValueError):
        MixedConfig(streams=0)


def test_a_long_prompt_waits_for_every_stream_to_be_midway_through_a_request():
    async def scenario():
        current = [0, 200, 10]  # one stream restarting, one near its end, one midway (256-token requests)
        waiter = asyncio.create_task(_streams_midway(current, 256, timeout=5.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # sent now, the prompt would meet two streams that stop or start
        current[0], current[1] = 4, 3  # the first got its tokens going, the second restarted
        await asyncio.wait_for(waiter, 1.0)

    asyncio.run(scenario())


def test_the_wait_gives_up_rather_than_hang():
    async def scenario():
        t0 = asyncio.get_running_loop().time()
        await _streams_midway([0], 256, timeout=0.1)  # a stream that never streams
        return asyncio.get_running_loop().time() - t0

    assert asyncio.run(scenario()) < 2.0
