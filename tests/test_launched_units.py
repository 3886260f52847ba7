"""CF-13 in small pieces: launched worlds (refimpl/launched.py), the rank processes
(refimpl/_rank_process.py) and refimpl's own workers (refimpl/multiprocess.py), without
torchrun.

These tests hold the red team's CF-13 survivors (mutation.md, issue 46): slips in those
three modules that the first tier of tests/test_launched.py and tests/test_multiprocess.py
let through. A launched world here is `LaunchedWorld` itself, one per rank, built from
the env:// variables as torchrun's agent sets them (every rank a client of one TCPStore,
hosted by the test) and driven by a thread per rank, so each test checks what every rank
sees. Worker processes are real, as under torchrun.
"""

from __future__ import annotations

import datetime
import functools
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from refimpl import launched, multiprocess
from refimpl._rank_process import (
    PEER_GRACE_S,
    RankError,
    RankTimeout,
    check_device,
    resolve_process_group,
    to_cpu,
)

# Process-group specs the workers import (the repository root is on their sys.path).
THIS_MODULE = "tests.test_launched_units"
BROKEN_ON_RANK_1 = f"{THIS_MODULE}:register_broken_on_rank_1"
REFUSING_RANK_1 = f"{THIS_MODULE}:register_refusing_rank_1"
GLOO_STARTING_LATE = f"{THIS_MODULE}:gloo_starting_late"
GLOO_APART_RANK_1_LATE = f"{THIS_MODULE}:register_gloo_apart_rank_1_late"
# How long a worker of GLOO_STARTING_LATE waits before it joins its group.
LATE_START_S = 1.5
# How long a thread standing in for a rank may take before it counts as never finished.
RANK_WAIT_S = 60.0


# --------------------------------------------------------------------------------------
# Process groups the tests start workers with
# --------------------------------------------------------------------------------------
def _register_once(name: str, creator) -> str:
    """`name`, registered as a CPU process group that `creator` makes, unless it is."""
    if name.lower() not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, creator, devices=["cpu"])
    return name


def _gloo_failing_on_rank_1(error: type, store, rank, size, timeout):
    if rank == 1:
        raise error("no fabric on rank 1")
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def register_broken_on_rank_1() -> str:
    """gloo, except that it cannot start on rank 1 (its creator raises there)."""
    return _register_once("refimpl_test_broken_on_rank_1",
                          functools.partial(_gloo_failing_on_rank_1, RuntimeError))


def register_refusing_rank_1() -> str:
    """gloo, except that its creator raises a ValueError (not torch's own error type) on
    rank 1."""
    return _register_once("refimpl_test_refusing_rank_1",
                          functools.partial(_gloo_failing_on_rank_1, ValueError))


def gloo_starting_late() -> str:
    """gloo, in a worker that takes LATE_START_S to start (a slow machine)."""
    time.sleep(LATE_START_S)
    return "gloo"


def _gloo_apart_rank_1_late(store, rank, size, timeout):
    """gloo on a loopback address of each rank's own, 127.0.0.(size - rank), rank 1 joining
    LATE_START_S after its peers. Of a pair, gloo's side with the higher address connects
    to the other's, at the address it reads from the store when it gets there: so rank 0
    connects to rank 1 before rank 1 has posted its address, at whatever address the
    store then holds under that key."""
    if rank == 1:
        time.sleep(LATE_START_S)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=f"127.0.0.{size - rank}")]
    return dist.ProcessGroupGloo(store, rank, size, options)


def register_gloo_apart_rank_1_late() -> str:
    """gloo on a loopback address per rank, rank 1 starting late (_gloo_apart_rank_1_late)."""
    return _register_once("refimpl_test_gloo_apart", _gloo_apart_rank_1_late)


def _never_created(store, rank, size, timeout):
    raise AssertionError("the tests only check this process group's name and devices")


def register_with_capitals() -> str:
    """A user's process group whose name has capitals (registered lower-cased)."""
    return _register_once("Refimpl_Test_Capitals", _never_created)


# --------------------------------------------------------------------------------------
# Rank functions (module level: the workers import them)
# --------------------------------------------------------------------------------------
def where() -> tuple:
    """Its rank and world, its process, and a real all_reduce of rank + 1."""
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return dist.get_rank(), dist.get_world_size(), os.getpid(), x.item()


def expected_where(n: int) -> list[tuple]:
    return [(r, n, n * (n + 1) / 2) for r in range(n)]


def without_pids(results: list[tuple]) -> list[tuple]:
    return [(r, n, total) for r, n, _, total in results]


def sleeps_on(rank: int, seconds: float = 3600.0, payload: bytes = b"") -> int:
    """Rank `rank` sleeps `seconds` first; `payload` only makes the task as large as asked."""
    if dist.get_rank() == rank:
        time.sleep(seconds)
    return dist.get_rank()


def raises_on_every_rank() -> None:
    raise ValueError(f"rank {dist.get_rank()} refuses")


def raises_on_1_and_returns_on_0() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    return dist.get_rank()


def raises_on_1_and_blocks_on_0() -> None:
    """Rank 0 ends up blocked in a collective whose peer has gone (gloo's own timeout is
    a minute)."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    dist.all_reduce(torch.ones(1))


def loopback_pin() -> str | None:
    return os.environ.get("GLOO_SOCKET_IFNAME")


# --------------------------------------------------------------------------------------
# Launched worlds in one process: a LaunchedWorld per rank, a thread per rank
# --------------------------------------------------------------------------------------
@pytest.fixture
def worlds(monkeypatch):
    """`make(size, specs=None, local_ranks=None, host="127.0.0.1")`: the LaunchedWorld of
    each rank of a world of `size`, as torchrun's agent starts them (every rank a client
    of one store), with each rank's process group spec (gloo by default). Every rank's
    workers are killed at the end."""
    made: list[launched.LaunchedWorld] = []
    servers = []

    def make(size, specs=None, local_ranks=None, host="127.0.0.1"):
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        servers.append(server)
        variables = {"WORLD_SIZE": size, "MASTER_ADDR": host, "MASTER_PORT": server.port,
                     "TORCHELASTIC_USE_AGENT_STORE": True}
        ranks = [_world_of_rank(monkeypatch, {**variables, "RANK": rank,
                                              "LOCAL_RANK": (local_ranks or range(size))[rank]},
                                (specs or ["gloo"] * size)[rank])
                 for rank in range(size)]
        made.extend(ranks)
        return ranks

    yield make
    for world in made:
        for n in list(world.workers):
            world.restart(n)


def _world_of_rank(monkeypatch, variables: dict, spec: str) -> launched.LaunchedWorld:
    """The LaunchedWorld a rank started with these env:// `variables` joins, its process
    group `spec` chosen (the variables are this process's only while it joins)."""
    with monkeypatch.context() as env:
        for key, value in variables.items():
            env.setenv(key, str(value))
        world = launched.LaunchedWorld()
    world.choose(spec, "cpu")
    return world


class Unfinished:
    """What a rank's thread gave when it had not finished within its wait."""

    def __repr__(self) -> str:
        return "Unfinished"


def on_every_rank(worlds_of_ranks, body, wait_s: float = RANK_WAIT_S) -> list:
    """`body(world)` on every rank at once, a thread each: per rank, what it returned or
    raised, or an `Unfinished` for a rank still running after `wait_s` seconds."""
    outcomes: list = [Unfinished() for _ in worlds_of_ranks]

    def run(rank, world):
        try:
            outcomes[rank] = body(world)
        except BaseException as exc:  # every outcome is the test's to judge
            outcomes[rank] = exc

    threads = [threading.Thread(target=run, args=(rank, world), daemon=True)
               for rank, world in enumerate(worlds_of_ranks)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + wait_s
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return outcomes


def assert_every_rank_returned(outcomes: list) -> None:
    assert all(isinstance(outcome, list) for outcome in outcomes), outcomes


def results_without_pids(outcomes: list) -> list:
    """Per rank, its call's results without the workers' pids, or what it raised."""
    return [without_pids(r) if isinstance(r, list) else r for r in outcomes]


def call(fn, n, *args, timeout_s=30.0):
    """A body for `on_every_rank`: one `run_on_ranks(fn, n, *args)` call of that rank."""
    return lambda world: world.run(fn, n, args, {}, timeout_s)


@pytest.fixture
def ranks_calling_run_on_ranks(monkeypatch):
    """`refimpl.multiprocess` sees the launched world of the calling thread's rank."""
    mine = threading.local()
    monkeypatch.setattr(launched, "current", lambda: getattr(mine, "world", None))

    def as_rank(body):
        def body_of(world):
            mine.world = world
            return body(world)
        return body_of

    return as_rank


# --------------------------------------------------------------------------------------
# The store exchange
# --------------------------------------------------------------------------------------
def test_a_gather_names_exactly_the_ranks_that_did_not_post_within_its_timeout(worlds):
    """Rank 1 of 3 never posts: ranks 0 and 2 each get both posts and None for rank 1
    only (a late rank does not make the ranks after it late), and within the gather's own
    timeout, not the store's (120 s; 20 s here, so that every wait ends within the test)."""
    ranks = worlds(3)
    for world in ranks:
        world.store.set_timeout(datetime.timedelta(seconds=20))
    together = threading.Barrier(2)

    def gather(world):
        # Both posting ranks start together, and the gather's timeout (3 s) leaves room for
        # a loaded machine: CI once saw rank 2 post more than 1 s after rank 0 began waiting.
        together.wait(timeout=20.0)
        return world._gather("posts", b"from %d" % world.rank, 3.0)

    started = time.monotonic()
    got = on_every_rank([ranks[0], ranks[2]], gather, wait_s=30.0)
    took = time.monotonic() - started
    assert got == [[b"from 0", None, b"from 2"]] * 2
    assert took < 12.0


def test_no_rank_finishes_before_every_rank_has_reached_the_end(worlds):
    """`finish` (the end of a launched run): whichever rank gets there last, rank 0 (which
    writes the report) or another, every rank leaves only once it got there."""
    ranks = worlds(2)
    for late in (0, 1):
        reached = {}

        def finish(world, late=late, reached=reached):
            if world.rank == late:
                time.sleep(1.0)
                reached["late"] = time.monotonic()
            world.finish()
            return time.monotonic()

        left = on_every_rank(ranks, finish, wait_s=30.0)
        assert all(isinstance(t, float) for t in left), left
        assert all(t >= reached["late"] for t in left), (late, left, reached)


class _SlowReader:
    """A rank's store whose reads of its peers' keys take `delay_s` (a slow link)."""

    def __init__(self, store, rank: int, delay_s: float):
        self._store, self._rank, self._delay_s = store, rank, delay_s

    def get(self, key):
        if not key.endswith(f"/{self._rank}"):
            time.sleep(self._delay_s)
        return self._store.get(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_rank_slow_to_read_its_peers_replies_still_finds_them(worlds):
    """Rank 1 reads its peers' keys late: rank 0 has read rank 1's reply and started the
    next call before rank 1 read rank 0's. The next call must not delete what rank 1
    has not read yet; both calls return on both ranks."""
    ranks = worlds(2)
    ranks[1].store.set_timeout(datetime.timedelta(seconds=10))  # a lost key: 10 s, not 120
    ranks[1].store = _SlowReader(ranks[1].store, 1, 0.5)
    got = on_every_rank(ranks, lambda world: [world.run(where, 1, (), {}, 20.0)
                                              for _ in range(2)])
    for outcome in got:
        assert isinstance(outcome, list), got
        assert [without_pids(r) for r in outcome] == [expected_where(1)] * 2, got


# --------------------------------------------------------------------------------------
# One call on every rank
# --------------------------------------------------------------------------------------
def test_a_launched_world_runs_a_call_of_its_own_size_and_skips_a_larger_one(
        worlds, ranks_calling_run_on_ranks):
    """`run_on_ranks` on a launched world of 2: a call on 2 ranks runs on both; one on 3,
    and one on 9 (more than refimpl's own workers allow on one machine: no limit of its
    own here) is NotOnThisWorld naming both numbers on every rank, before anything ran."""
    ranks = worlds(2)

    def calls(world):
        outcomes = [without_pids(multiprocess.run_on_ranks(where, 2))]
        for n in (3, multiprocess.MAX_WORKER_PROCESSES + 1):
            try:
                multiprocess.run_on_ranks(where, n)
                outcomes.append(f"ran on {n}")
            except launched.NotOnThisWorld as exc:
                outcomes.append((str(exc), exc.needs_ranks))
        return outcomes

    got = on_every_rank(ranks, ranks_calling_run_on_ranks(calls))
    assert got == [[expected_where(2),
                    ("needs 3 ranks; the launched world has 2", 3),
                    ("needs 9 ranks; the launched world has 2", 9)]] * 2


def test_ranks_that_call_one_function_on_different_sizes_are_named_out_of_step(worlds):
    """Ranks 0 and 1 of 3 run `where` on 1 rank, rank 2 on 2: each rank raises
    MismatchedRanks naming the calls that differ."""
    ranks = worlds(3)
    got = on_every_rank(ranks, lambda world: world.run(where, 2 if world.rank == 2 else 1,
                                                       (), {}, 20.0))
    label = f"{where.__module__}.{where.__qualname__}"
    for rank, outcome in enumerate(got):
        assert isinstance(outcome, launched.MismatchedRanks), (rank, outcome)
        named = f"rank 0 ran {label} on 1 ranks where rank 2 ran {label} on 2" if rank == 2 \
            else f"rank 2 ran {label} on 2 ranks where rank {rank} ran {label} on 1"
        assert named in str(outcome) and "[CF-13]" in str(outcome), (rank, outcome)


def test_every_launched_rank_raises_the_lowest_failing_ranks_error(worlds):
    """Both ranks' functions raise: both ranks raise the same RankError, rank 0's."""
    ranks = worlds(2)
    got = on_every_rank(ranks, call(raises_on_every_rank, 2))
    for outcome in got:
        assert isinstance(outcome, RankError), got
        assert (outcome.rank, outcome.exc_type, outcome.message) == \
            (0, "ValueError", "rank 0 refuses"), got


def test_a_call_that_timed_out_restarts_the_workers_of_its_size(worlds):
    """Rank 1's function hangs: every rank raises RankTimeout naming rank 1, and the next
    call of that size gets fresh workers and returns on every rank."""
    ranks = worlds(2)
    assert_every_rank_returned(on_every_rank(ranks, call(where, 2)))  # workers started
    hung = on_every_rank(ranks, call(sleeps_on, 2, 1, timeout_s=2.0))
    for outcome in hung:
        assert isinstance(outcome, RankTimeout) and outcome.ranks == [1], hung
    after = on_every_rank(ranks, call(where, 2, timeout_s=15.0))
    assert results_without_pids(after) == [expected_where(2)] * 2


def test_an_idle_rank_waits_for_a_late_workers_timeout_reply(worlds):
    """Rank 0's worker starts late and the task it is handed is large (the hand-over waits
    for the worker), so its own wait starts LATE_START_S after the idle rank 1's. Its
    function hangs: both ranks raise RankTimeout naming rank 0, neither calls the world
    lost, and the next call returns on both."""
    ranks = worlds(2, specs=[GLOO_STARTING_LATE, "gloo"])
    large = b"x" * (8 << 20)  # far more than a socket's buffer
    hung = on_every_rank(ranks, call(sleeps_on, 1, 0, 3600.0, large, timeout_s=2.0))
    for outcome in hung:
        assert isinstance(outcome, RankTimeout) and outcome.ranks == [0], hung
    assert [world.lost for world in ranks] == [None, None]
    after = on_every_rank(ranks, call(where, 1, timeout_s=15.0))
    assert results_without_pids(after) == [expected_where(1)] * 2


def test_a_rank_blocked_after_its_peer_failed_gives_up_after_the_grace(worlds):
    """Rank 1 raises, rank 0 is left blocked in a collective (gloo would wait a minute):
    rank 0 stops waiting PEER_GRACE_S after the failure, and every rank raises rank 1's
    error well within the call's timeout (50 s) and gloo's own (a minute)."""
    ranks = worlds(2)
    assert_every_rank_returned(on_every_rank(ranks, call(where, 2)))  # workers started
    started = time.monotonic()
    got = on_every_rank(ranks, call(raises_on_1_and_blocks_on_0, 2, timeout_s=50.0),
                        wait_s=30.0)
    took = time.monotonic() - started
    for outcome in got:
        assert isinstance(outcome, RankError) and outcome.rank == 1, got
    assert took < 30.0


def test_a_failed_call_does_not_cut_the_wait_of_the_next_call(worlds):
    """After a call in which rank 1 raised, a call whose rank 0 takes longer than
    PEER_GRACE_S (within its timeout) returns on every rank: the peer-failed flag was
    that call's."""
    ranks = worlds(2)
    failed = on_every_rank(ranks, call(raises_on_1_and_returns_on_0, 2))
    assert all(isinstance(outcome, RankError) and outcome.rank == 1 for outcome in failed)
    slow = on_every_rank(ranks, call(sleeps_on, 2, 0, PEER_GRACE_S + 1.0, timeout_s=30.0))
    assert slow == [[0, 1], [0, 1]]


def test_fresh_workers_after_shutdown_meet_afresh_on_every_rank(
        worlds, ranks_calling_run_on_ranks):
    """`shutdown(2)` under a launched world stops every rank's worker of size 2; the next
    call starts fresh ones, which form their group even when one of them starts late
    (rank 0 connects to the late rank 1 at the address it finds in the store: the old
    group's, whose worker is gone, would never answer)."""
    ranks = worlds(2, specs=[GLOO_APART_RANK_1_LATE] * 2)

    def twice(world):
        first = multiprocess.run_on_ranks(where, 2, timeout=20.0)
        multiprocess.shutdown(2)
        return first, multiprocess.run_on_ranks(where, 2, timeout=20.0)

    got = on_every_rank(ranks, ranks_calling_run_on_ranks(twice))
    for outcome in got:
        assert isinstance(outcome, tuple), got
        first, second = outcome
        assert without_pids(first) == without_pids(second) == expected_where(2)
        assert not {pid for _, _, pid, _ in first} & {pid for _, _, pid, _ in second}


def test_a_process_group_that_fails_to_start_names_the_rank_in_the_world(worlds):
    """Two machines of one process each (local rank 0 on both), the process group cannot
    start on rank 1: every rank raises rank 1's error, naming --process-group and rank 1
    of 2 (its rank in the world, not its local rank)."""
    ranks = worlds(2, specs=[BROKEN_ON_RANK_1] * 2, local_ranks=[0, 0])
    got = on_every_rank(ranks, call(where, 2, timeout_s=30.0))
    for outcome in got:
        assert isinstance(outcome, RankError) and outcome.rank == 1, got
        assert f"--process-group {BROKEN_ON_RANK_1}: the process group did not start on " \
               "rank 1 of 2: no fabric on rank 1 [CF-13]" in outcome.message, got


def test_a_launched_worker_is_not_pinned_to_loopback(worlds):
    """Workers of a world whose store is on a named host (its peers may be on other
    machines) choose gloo's interface as gloo does: not pinned to `lo`, which only the
    harness's own workers on 127.0.0.1 are."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        pytest.skip("GLOO_SOCKET_IFNAME is set for every process of this run")
    (world,) = worlds(1, host="localhost")
    assert on_every_rank([world], call(loopback_pin, 1)) == [[None]]


# --------------------------------------------------------------------------------------
# The choices a worker is started with, and its replies
# --------------------------------------------------------------------------------------
def test_a_process_group_module_without_the_attribute_is_the_options_error():
    """`module:attr` whose module imports but has no `attr`: the option's ValueError."""
    with pytest.raises(ValueError) as info:
        resolve_process_group("tests.broken_process_group:no_such_function")
    assert "--process-group tests.broken_process_group:no_such_function: cannot import " \
           "it" in str(info.value) and "[CF-13]" in str(info.value)


def test_a_registered_process_group_named_with_capitals_is_accepted():
    """torch keeps registered names lower-cased; the name as its function spells it is
    accepted, and its devices are read."""
    name = resolve_process_group(f"{THIS_MODULE}:register_with_capitals")
    assert name == "Refimpl_Test_Capitals"
    check_device("cpu", name)


def test_a_process_group_that_cannot_serve_the_cpu_is_refused_for_it():
    """A process group registered for cuda only, with --device cpu: refused at once,
    naming --device and the devices it serves."""
    name = "refimpl_test_cuda_only"
    if name not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, _never_created, devices=["cuda"])
    with pytest.raises(ValueError) as info:
        check_device("cpu", name)
    assert f"--device cpu: process group '{name}' serves cuda, not cpu" in str(info.value)
    assert "[CF-13]" in str(info.value)


class _OnAnotherDevice(torch.Tensor):
    """Stands for a tensor on a rank's accelerator: `.cpu()` gives a plain tensor."""

    def cpu(self, *args, **kwargs):
        return torch.Tensor.cpu(self, *args, **kwargs).as_subclass(torch.Tensor)


def test_results_come_back_on_the_cpu_however_nested():
    """Every tensor of a rank's result, in lists, tuples and dicts too, goes through
    `.cpu()`."""
    on_device = torch.arange(3.0).as_subclass(_OnAnotherDevice)
    back = to_cpu({"list": [on_device], "tuple": (on_device, 1), "alone": on_device})
    leaves = [back["list"][0], back["tuple"][0], back["alone"]]
    assert [type(t) for t in leaves] == [torch.Tensor] * 3
    assert all(torch.equal(t, torch.arange(3.0)) for t in leaves)
    assert back["tuple"][1] == 1


# --------------------------------------------------------------------------------------
# refimpl's own workers
# --------------------------------------------------------------------------------------
def test_the_harness_checks_and_restarts_its_workers_for_a_new_device(monkeypatch):
    """A kept worker group was started for --device cpu; a call made with another device
    (REFIMPL_DEVICE) is checked anew: a device this machine lacks is refused, naming
    --device."""
    monkeypatch.delenv("REFIMPL_DEVICE", raising=False)
    assert without_pids(multiprocess.run_on_ranks(where, 2)) == expected_where(2)
    monkeypatch.setenv("REFIMPL_DEVICE", "meta")
    with pytest.raises(ValueError, match=r"--device meta: this machine has no meta device "
                                         r"\[CF-13\]"):
        multiprocess.run_on_ranks(where, 2)


@pytest.mark.parametrize("spec, error", [(BROKEN_ON_RANK_1, "RuntimeError"),
                                         (REFUSING_RANK_1, "ValueError")],
                         ids=["RuntimeError", "ValueError"])
def test_the_harness_names_a_process_group_that_failed_to_start_on_one_rank(monkeypatch,
                                                                            spec, error):
    """refimpl's own workers, the process group cannot start on rank 1 (rank 0 is left
    waiting for it): the call raises rank 1's own error, of the type its creator raised
    (whatever it is: a vendor's need not be torch's), naming --process-group and the
    rank, not a timeout of rank 0 nor a rank that died."""
    monkeypatch.setenv("REFIMPL_PROCESS_GROUP", spec)
    with pytest.raises(RankError) as info:
        multiprocess.run_on_ranks(where, 2, timeout=30.0)
    assert (info.value.rank, info.value.exc_type) == (1, error), info.value
    assert f"--process-group {spec}: the process group did not start on rank 1 " \
           "of 2: no fabric on rank 1 [CF-13]" in info.value.message


# A task larger than the socket's buffer (about 208 KiB here) is taken by a worker only
# once its process group has formed; one whose peer cannot start it waits out gloo's
# rendezvous (PG_TIMEOUT_S, 60 s). The call's timeout must bound that hand-over too, so
# that the peer's own error comes back, on refimpl's own workers and on every launched
# rank alike (found by the red team's helper: the call used to block in the send).
LARGE_PAYLOAD = b"x" * (4 << 20)


def test_the_harness_hands_a_large_task_over_within_the_calls_timeout(monkeypatch):
    monkeypatch.setenv("REFIMPL_PROCESS_GROUP", BROKEN_ON_RANK_1)
    with pytest.raises(RankError) as info:
        multiprocess.run_on_ranks(sleeps_on, 2, 5, 0.0, LARGE_PAYLOAD, timeout=5.0)
    assert info.value.rank == 1 and "no fabric on rank 1 [CF-13]" in info.value.message


def test_a_launched_rank_hands_a_large_task_over_within_the_calls_timeout(worlds):
    ranks = worlds(2, specs=[BROKEN_ON_RANK_1] * 2)
    got = on_every_rank(ranks, call(sleeps_on, 2, 5, 0.0, LARGE_PAYLOAD, timeout_s=5.0))
    for rank, outcome in enumerate(got):
        assert isinstance(outcome, RankError) and outcome.rank == 1, f"rank {rank}: {outcome!r}"
        assert "no fabric on rank 1" in outcome.message, f"rank {rank}: {outcome.message}"
    assert [w.lost for w in ranks] == [None, None]


TORCHRUN_VARIABLES = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": "29500"}


@pytest.mark.parametrize("variables, launched_world", [
    ({"TORCHELASTIC_RUN_ID": "abc", **TORCHRUN_VARIABLES}, True),  # a plain torchrun
    ({"REFIMPL_LAUNCHED": "1", **TORCHRUN_VARIABLES}, True),  # another launcher
    ({"REFIMPL_LAUNCHED": "0", "TORCHELASTIC_RUN_ID": "abc", **TORCHRUN_VARIABLES}, False),
    (TORCHRUN_VARIABLES, False),  # env:// alone: a process group of the caller's own
], ids=["torchrun", "refimpl_launched", "refimpl_launched_0", "neither"])
def test_a_launched_world_is_recognised_by_torchruns_variables_or_the_flag(
        monkeypatch, variables, launched_world):
    for key in ("TORCHELASTIC_RUN_ID", "REFIMPL_LAUNCHED", *TORCHRUN_VARIABLES):
        monkeypatch.delenv(key, raising=False)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    assert launched.launched_by_env() is launched_world


def test_torchrun_without_the_env_variables_is_refused_naming_them(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.delenv("REFIMPL_LAUNCHED", raising=False)
    for key, value in TORCHRUN_VARIABLES.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(RuntimeError, match=r"\['MASTER_PORT'\] are not set \[CF-13\]"):
        launched.launched_by_env()
