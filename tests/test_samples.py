"""Raw samples on disk: one file per point while a sweep runs, one pack when it has finished, and
the same table read back whichever of the two (or both, after a kill in the middle of packing, or a
point measured again after the pack) holds a point."""

import numpy as np
import pandas as pd
import pytest

from lorabench.storage.samples import FOLDER, PACKED, SCHEMA, has_samples, pack_samples, read_samples, write_samples


def steps(point: int, n: int, scale: float = 1.0) -> dict[str, list]:
    ms = (np.arange(n) + 1.0 + point / 10) * scale
    return {"turn": list(np.arange(n) // 2), "step_ms": list(ms), "host_us": list(ms * 7), "copy_us": [1.0] * n,
            "launch_us": [2.0] * n, "n_active": [point % 3] * n, "launches": [1] * n, "tokens": [4] * n,
            "loads": [0] * n}


def written(run, points: dict[int, int]) -> pd.DataFrame:
    for p, n in points.items():
        write_samples(run, p, steps(p, n))
    return read_samples(run)


def point_files(run) -> list[str]:
    return sorted(f.name for f in (run / FOLDER).glob("point-*.parquet"))


def test_a_pack_reads_as_its_files_did(tmp_path):
    before = written(tmp_path, {0: 5, 3: 7, 1: 1, 12: 4})
    pack_samples(tmp_path)
    assert point_files(tmp_path) == [] and (tmp_path / PACKED).is_file() and has_samples(tmp_path)
    after = read_samples(tmp_path)
    pd.testing.assert_frame_equal(before, after)
    assert list(after.columns) == SCHEMA.names and len(after) == 17
    assert list(after.drop_duplicates("point").point) == [0, 1, 3, 12]
    pd.testing.assert_frame_equal(read_samples(tmp_path, [3, 12, 99]),
                                  before[before.point.isin([3, 12])].reset_index(drop=True))


def test_a_point_measured_again_after_the_pack_replaces_its_packed_steps(tmp_path):
    written(tmp_path, {0: 5, 1: 6})
    pack_samples(tmp_path)
    write_samples(tmp_path, 1, steps(1, 3, scale=100.0))  # a resumed run measures point 1 again
    df = read_samples(tmp_path)
    assert df.groupby("point").size().to_dict() == {0: 5, 1: 3}
    assert df[df.point == 1].step_ms.min() >= 100
    assert len(read_samples(tmp_path, [1])) == 3 and len(read_samples(tmp_path, [0])) == 5
    pack_samples(tmp_path)  # the resumed run finishes: one pack, the new steps in it
    assert point_files(tmp_path) == []
    pd.testing.assert_frame_equal(read_samples(tmp_path), df)


def test_a_pack_killed_before_its_files_were_removed_counts_each_step_once(tmp_path):
    before = written(tmp_path, {0: 5, 2: 6})
    files = {f: f.read_bytes() for f in (tmp_path / FOLDER).glob("point-*.parquet")}
    pack_samples(tmp_path)
    for f, data in files.items():  # as if killed after the pack's rename, before any unlink
        f.write_bytes(data)
    pd.testing.assert_frame_equal(read_samples(tmp_path), before)


@pytest.mark.parametrize("packed", [False, True])
def test_a_run_without_samples_reads_empty(tmp_path, packed):
    if packed:
        pack_samples(tmp_path)  # nothing to pack: no file is made
    df = read_samples(tmp_path)
    assert df.empty and list(df.columns) == SCHEMA.names and not has_samples(tmp_path)
    assert not (tmp_path / FOLDER).exists()


def test_a_step_timed_at_the_hosts_pace_says_so():
    import numpy as np
    from lorabench.runtime.rows import host_bound

    ms, us = np.array([38.97, 39.1]), np.array([38_700.0, 38_900.0])  # mixed steps whose host launched all the time
    assert host_bound(us, ms) == "host-bound: 100 % of the time in steps whose launches took >= 90 % of them"
    assert host_bound(np.array([60.0, 55.0]), np.array([6.28, 6.3])) is None  # replayed graphs: microseconds to launch
    # a loop: 97 decode replays of 8 ms, 3 host-bound mixed steps of 60 ms (19 % of the time), however the medians fall
    ms, us = np.array([8.0] * 97 + [60.0] * 3), np.array([40.0] * 97 + [59_000.0] * 3)
    assert host_bound(us, ms).startswith("host-bound: 19 %")
    assert host_bound(np.array([0.0]), np.array([0.0])) is None


def test_a_loops_stalled_step_says_so():
    """A serving loop's step that took 1 s among 47 ms steps of its size (it compiled kernels, H100):
    one such step sets a TTFT p99 of few requests, so the row says it; loads and prompt steps
    beside decode steps are not stalls. A step with few others of its size is held against the
    larger steps."""
    import numpy as np
    from lorabench.runtime.rows import stalls

    tokens = np.array([16] * 95 + [2048, 2048, 1615, 1616, 2048])
    ms = np.array([8.4] * 90 + [23.0] * 5 + [47.0, 46.5, 1001.5, 47.2, 48.0])  # 5 decode steps with a load
    assert stalls(ms, tokens) == ("1 step(s) took >= 5x the median of steps of their size, the longest 1002 ms at "
                                  "1615 tokens (a compile or a stall: latency tails read high)")
    ms[97] = 47.1
    assert stalls(ms, tokens) is None
    lone = np.append(tokens, 313)  # no other step of 157 to 626 tokens: against the steps of 157 or more
    assert stalls(np.append(ms, 366.0), lone).startswith("1 step(s) took >= 5x") and stalls(np.append(ms, 30.0), lone) is None
    assert stalls(np.array([0.0, 0.0]), np.array([0, 1])) is None  # a size of no time: nothing stands out
