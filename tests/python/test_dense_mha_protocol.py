"""tools/dense_mha_protocol.py, the host model of the dense wgmma kernel's synchronization: the
kernel's protocol holds under fresh random interleavings of every tile shape it models, and each
known-wrong protocol (a mutant) is caught, so the model can fail."""
import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("dense_mha_protocol",
                                              REPO / "tools" / "dense_mha_protocol.py")
protocol = importlib.util.module_from_spec(spec)
spec.loader.exec_module(protocol)


def test_the_kernel_protocol_holds(rng):
    failures = protocol.check(seed=int(rng.integers(1 << 62)), reps=8)
    assert failures == []


@pytest.mark.parametrize("mutant", protocol.MUTANTS)
def test_a_wrong_protocol_is_caught(rng, mutant):
    failures = protocol.check(seed=int(rng.integers(1 << 62)), reps=8, mutant=mutant,
                              max_failures=1)
    assert failures, f"the model did not catch {mutant}"
