import numpy as np
import pytest

from arl.api import GenerationConfig, SampleOutput, Trajectory, TrajectoryBuilder
from arl.api.registry import Registry, RegistryError


def test_generation_config_validate_names_field():
    GenerationConfig().validate()
    for kw, field in [({"n": 0}, "n"), ({"temperature": 0.0}, "temperature"), ({"top_p": 1.5}, "top_p"),
                      ({"top_k": -1}, "top_k"), ({"min_new_tokens": 99}, "min_new_tokens")]:
        with pytest.raises(ValueError, match=field):
            GenerationConfig(**kw).validate()
    GenerationConfig(temperature=0.0, greedy=True).validate()


def test_generation_config_from_dict_rejects_unknown():
    with pytest.raises(ValueError, match="unknown"):
        GenerationConfig.from_dict({"n": 1, "bogus": 2})


def test_builder_masks_and_versions():
    b = TrajectoryBuilder([1, 2, 3])
    b.add_generated(SampleOutput([4, 5], [-0.1, -0.2], [7, 8], "stop"))
    b.add_context([9])
    t = b.build(reward=1.0, group_id="g")
    assert t.input_ids.tolist() == [1, 2, 3, 4, 5, 9]
    assert t.loss_mask.tolist() == [0, 0, 0, 1, 1, 0]
    assert t.versions.tolist() == [-1, -1, -1, 7, 8, -1]
    np.testing.assert_allclose(t.logprobs, [0, 0, 0, -0.1, -0.2, 0], atol=1e-7)
    assert t.num_generated == 2


def test_trajectory_length_mismatch():
    with pytest.raises(ValueError, match="one length"):
        Trajectory([1, 2], [0], [0, 0], [0, 0], 0.0, "g")


def test_trajectory_turn_discount_is_none_or_in_unit_interval():
    args = ([1, 2], [0, 1], [0, -1], [-1, 0], 1.0, "g")
    assert Trajectory(*args).turn_discount is None
    assert Trajectory(*args, turn_discount=0).turn_discount == 0.0
    assert Trajectory(*args, turn_discount=np.float32(0.5)).turn_discount == 0.5
    for bad in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="turn_discount"):
            Trajectory(*args, turn_discount=bad)


def test_sample_output_bad_finish_reason():
    with pytest.raises(ValueError, match="finish_reason"):
        SampleOutput([1], [0.0], [0], "done")


def test_registry_duplicate_and_unknown_list_names():
    r: Registry = Registry("agent")
    r.register("a", int)
    r.register("a", int)  # same object again is fine (re-import)
    with pytest.raises(RegistryError, match=r"registered agents: \['a'\]"):
        r.register("a", str)
    with pytest.raises(RegistryError, match=r"unknown agent 'b'.*\['a'\]"):
        r.get("b")


def test_trajectory_says_whether_its_agent_reported_a_void_turn():
    def traj(**metadata):
        return Trajectory([1], [1], [0.0], [0], 0.0, "g", metadata=metadata)

    assert not traj().has_void_turn and not traj(void_turns=0).has_void_turn and not traj(void_turns=None).has_void_turn
    assert traj(void_turns=2).has_void_turn
