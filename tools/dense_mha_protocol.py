#!/usr/bin/env python3
"""A host model of the synchronization of the dense MHA wgmma kernel
(src/cuda/sm90/prefill/dense_mha/dense_mha_kernel.cuh), run under random interleavings.

The producer's lane 0 (and its warp's zeroing of a block past the tile's rows), consumer groups
WG0 and WG1 (128 threads each, arriving together), the K / V ring's mbarriers (arrival counts,
transaction bytes, phase parity), the turn and hand-over named barriers and the TMA completions
are modelled step by step; an interleaving fails on a deadlock, a stage overwritten while a
group reads it, a group reading another block than it expects, a hand-over while a copy is in
flight, or a named barrier left with arrivals. Both of the kernel's modes: two groups on
separate rows (every block for both), and split blocks (a tile of <= 64 rows over >= 2 blocks:
group w takes blocks w, w + 2, ...). `--mutant` runs a known-wrong protocol, which must fail.

Usage: tools/dense_mha_protocol.py [--seed N] [--reps N] [--mutant NAME]
"""
import argparse
import random
import sys

K_STAGES = 2  # the kernel's kStages
ROWS_PER_GROUP = 64  # kWgRows


class MBarrier:
    """An mbarrier: `count` arrivals and the expected transaction bytes complete a phase."""

    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, n=1):
        self.pending -= n
        assert self.pending >= 0, "more arrivals than the barrier's count"
        self._complete()

    def arrive_expect_tx(self, nbytes):
        self.tx += nbytes
        self.arrive()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def passed(self, parity):
        """try_wait.parity: the phase of this parity has completed."""
        return (self.phase & 1) != parity


class NamedBarrier:
    """bar.sync / bar.arrive over 256 threads; `generation` counts completed rounds."""

    def __init__(self):
        self.arrived, self.generation = 0, 0

    def arrive(self, threads):
        self.arrived += threads
        if self.arrived == 256:
            self.arrived, self.generation = 0, self.generation + 1
        assert self.arrived < 256


MUTANTS = ("release_count_256", "turns_of_own_blocks", "handover_without_drain")


def wait(cond):
    """A spin on `cond`: yields (one scheduling step) until it holds."""
    while not cond():
        yield


def simulate(q_len, first_pos, tile_blocks, block_n, rng, mutant=None):
    """One CTA over a tile of q_len rows from position first_pos and blocks [0, tile_blocks);
    returns None, or what went wrong."""
    kv_len = first_pos + q_len
    num_blocks = max(0, min(tile_blocks, (kv_len + block_n - 1) // block_n))
    split = q_len <= ROWS_PER_GROUP and num_blocks >= 2
    releasers = 128 if split and mutant != "release_count_256" else 256
    bar_q = MBarrier(1)
    k_full = [MBarrier(1) for _ in range(K_STAGES)]
    k_empty = [MBarrier(releasers) for _ in range(K_STAGES)]
    v_full = [MBarrier(1) for _ in range(K_STAGES)]
    v_empty = [MBarrier(releasers) for _ in range(K_STAGES)]
    v_staged = [MBarrier(1) for _ in range(K_STAGES)]
    named = {1: NamedBarrier(), 2: NamedBarrier(), 3: NamedBarrier()}  # turns 1, 2; hand-over 3
    held = {"K": [None] * K_STAGES, "V": [None] * K_STAGES}  # the block each stage holds
    readers = {"K": [set() for _ in range(K_STAGES)], "V": [set() for _ in range(K_STAGES)]}
    landings = []  # TMA copies in flight: callables that land them
    stage_of = lambda i: i % K_STAGES
    phase_of = lambda i: (i // K_STAGES) & 1

    def tma(bar, kind, block):
        stage = stage_of(block)
        assert not readers[kind][stage], f"{kind} stage {stage} refilled while read"

        def land():
            assert not readers[kind][stage], f"{kind} stage {stage} landing under a reader"
            held[kind][stage] = block
            bar.complete_tx(1)

        landings.append(land)

    def producer():
        if num_blocks == 0:
            return
        bar_q.arrive_expect_tx(1)
        landings.append(lambda: bar_q.complete_tx(1))
        k_ahead = 1 if split else 0
        k_next = 0
        for i in range(num_blocks):
            while k_next <= i + k_ahead and k_next < num_blocks:
                j = k_next
                yield from wait(lambda: k_empty[stage_of(j)].passed(phase_of(j) ^ 1))
                k_full[stage_of(j)].arrive_expect_tx(1)
                tma(k_full[stage_of(j)], "K", j)
                k_next += 1
            whole = kv_len - i * block_n >= block_n
            yield from wait(lambda: v_empty[stage_of(i)].passed(phase_of(i) ^ 1))
            bar = v_full[stage_of(i)] if whole else v_staged[stage_of(i)]
            bar.arrive_expect_tx(1)
            tma(bar, "V", i)
            if not whole:  # the warp zeroes the rows past the tile's, then releases the block
                yield from wait(lambda: v_staged[stage_of(i)].passed(0))
                assert not readers["V"][stage_of(i)]
                v_full[stage_of(i)].arrive()

    def consumer(wg):
        me = f"WG{wg}"
        row_base = 0 if split else ROWS_PER_GROUP * wg
        my_rows = max(0, min(q_len - row_base, ROWS_PER_GROUP))
        my_end = 0 if my_rows == 0 else min(num_blocks,
                                            (first_pos + row_base + my_rows + block_n - 1) // block_n)
        first, step = (wg, 2) if split else (0, 1)
        my_blocks = max(0, my_end - first + step - 1) // step
        turn_blocks = (num_blocks + 1) // 2 if split else num_blocks
        if split and mutant == "turns_of_own_blocks":
            turn_blocks = my_blocks
        num_turns = turn_blocks + 1 if num_blocks > 0 else 0
        turn = 0

        def take_turn():
            bar = named[1 + wg]
            generation = bar.generation
            bar.arrive(128)
            yield from wait(lambda: bar.generation > generation)

        def pass_turn():
            nonlocal turn
            if wg == 0 or turn + 1 < num_turns:
                named[2 - wg].arrive(128)
            turn += 1

        def read(kind, block):
            assert held[kind][stage_of(block)] == block, f"{me} expected {kind} of block {block}"
            readers[kind][stage_of(block)].add(me)

        def release(kind, block, bars):
            readers[kind][stage_of(block)].discard(me)
            bars[stage_of(block)].arrive(128)

        if wg == 1 and num_turns > 0:
            named[1].arrive(128)
        if my_blocks > 0:  # the first S
            yield from wait(lambda: bar_q.passed(0))
            yield from wait(lambda: k_full[stage_of(first)].passed(phase_of(first)))
            yield from take_turn()
            read("K", first)
            pass_turn()
            yield  # the wgmma runs
            release("K", first, k_empty)
        for j in range(my_blocks):
            i, has_next = first + j * step, j + 1 < my_blocks
            nxt = i + step
            if has_next:
                yield from wait(lambda: k_full[stage_of(nxt)].passed(phase_of(nxt)))
            yield from wait(lambda: v_full[stage_of(i)].passed(phase_of(i)))
            yield from take_turn()
            if has_next:
                read("K", nxt)
            read("V", i)
            pass_turn()
            yield
            if has_next:
                release("K", nxt, k_empty)
            yield
            release("V", i, v_empty)
        if split:
            while turn < num_turns:
                yield from take_turn()
                pass_turn()
            # The hand-over: both groups drained (bar.sync 3), WG1 writes and arrives, WG0
            # waits for it (bar.sync 3).
            bar = named[3]
            if mutant != "handover_without_drain":
                generation = bar.generation
                bar.arrive(128)
                yield from wait(lambda: bar.generation > generation)
            if wg == 1:
                assert not landings, "hand-over while a copy is in flight"
                assert not any(readers["K"]) and not any(readers["V"]), "hand-over under a reader"
                bar.arrive(128)
                return
            generation = bar.generation
            bar.arrive(128)
            yield from wait(lambda: bar.generation > generation)
        else:
            if my_blocks == 0 and num_blocks > 0:
                yield from take_turn()
                pass_turn()
            for i in range(my_blocks, num_blocks):
                yield from wait(lambda: k_full[stage_of(i)].passed(phase_of(i)))
                yield from wait(lambda: v_full[stage_of(i)].passed(phase_of(i)))
                yield from take_turn()
                pass_turn()
                k_empty[stage_of(i)].arrive(128)
                v_empty[stage_of(i)].arrive(128)

    agents = {"producer": producer(), "WG0": consumer(0), "WG1": consumer(1)}
    for steps in range(200000):
        if not agents and not landings:
            break
        choice = rng.choice(list(agents) + (["landing"] if landings else []))
        if choice == "landing":
            landings.pop(rng.randrange(len(landings)))()
            continue
        try:
            next(agents[choice])
        except StopIteration:
            del agents[choice]
    else:
        return f"deadlock (still running: {', '.join(agents)})"
    for bar_id, bar in named.items():
        assert bar.arrived == 0, f"named barrier {bar_id} left with {bar.arrived} arrivals"
    return None


def check(seed=1, reps=6, mutant=None, max_failures=10):
    """Every tile shape of interest under `reps` random interleavings each; returns the
    failures' descriptions."""
    rng = random.Random(seed)
    failures = []
    for block_n in (128, 80):
        for q_len in (1, 5, 40, 63, 64, 65, 100, 128):
            for first_pos in (0, 3, 60, 100, 127, 128, 129, 300, 700):
                for extra in (0, 1, 3):  # the tile's block_end past the blocks its rows see
                    tile_blocks = (first_pos + q_len + block_n - 1) // block_n + extra
                    for _ in range(reps):
                        try:
                            r = simulate(q_len, first_pos, tile_blocks, block_n, rng, mutant)
                        except AssertionError as e:
                            r = f"assertion: {e}"
                        if r:
                            failures.append(f"q_len {q_len} first_pos {first_pos} block_n "
                                            f"{block_n} tile blocks {tile_blocks}: {r}")
                            if len(failures) >= max_failures:
                                return failures
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reps", type=int, default=6, help="interleavings per tile shape")
    ap.add_argument("--mutant", choices=MUTANTS, help="a known-wrong protocol (must fail)")
    a = ap.parse_args()
    failures = check(a.seed, a.reps, a.mutant)
    for f in failures:
        print(f)
    print(f"{'fails' if failures else 'holds'}: {len(failures)} failing interleavings")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
