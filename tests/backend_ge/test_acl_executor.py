"""The pyACL executor against the fake pyACL runtime (tests/backend_ge/fake_acl.py)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from backend_ge import dtypes
from backend_ge.executors.acl import AclError, AclExecutor
from backend_ge.executors.base import ExecutorError
from tests.backend_ge.builders import mlp_model
from tests.backend_ge.fake_acl import FakeAcl, write_fake_om

GEARS = [1, 2, 4, 8]


@pytest.fixture
def fake():
    return FakeAcl(device_count=2)


@pytest.fixture
def dynamic_om(tmp_path):
    return write_fake_om(mlp_model(), tmp_path / "model.om", GEARS)


@pytest.fixture
def static_om(tmp_path):
    model = mlp_model()
    for vi in list(model.graph.input) + list(model.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_value = 2
    return write_fake_om(model, tmp_path / "static.om")


def feeds(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((n, 4)).astype(np.float32),
        "ids": rng.integers(-50, 50, (n, 2)).astype(np.int32),
    }


def reference(inputs):
    sess = ort.InferenceSession(mlp_model().SerializeToString(), providers=["CPUExecutionProvider"])
    y, ids2 = sess.run(None, inputs)
    return {"y": y, "ids2": ids2}


def test_specs_come_from_the_model_description(fake, dynamic_om):
    with AclExecutor(str(dynamic_om), device_id=1, acl_module=fake) as ex:
        assert [(s.name, s.dtype, s.shape) for s in ex.inputs] == [
            ("x", dtypes.from_wire("FP32"), (-1, 4)),
            ("ids", dtypes.from_wire("INT32"), (-1, 2)),
        ]
        assert [s.name for s in ex.outputs] == ["y", "ids2"]
        assert ex.max_batch_size == 8 and ex.batch_gears == GEARS
        assert fake.devices_set == {1: 1}


def test_setup_and_teardown_follow_the_pyacl_call_order(fake, dynamic_om):
    ex = AclExecutor(str(dynamic_om), acl_module=fake)
    ex.run(feeds(2))
    ex.close()
    order = [c for c in fake.calls if not c.startswith("mdl.get_") or c in ("mdl.get_desc",)]
    first = {name: order.index(name) for name in dict.fromkeys(order)}
    expected = [
        "init", "rt.set_device", "rt.create_context", "mdl.load_from_file", "mdl.create_desc", "mdl.get_desc",
        "mdl.create_dataset", "rt.malloc", "create_data_buffer", "mdl.add_dataset_buffer", "rt.memcpy",
        "mdl.set_dynamic_batch_size", "mdl.execute", "destroy_data_buffer", "mdl.destroy_dataset", "mdl.unload",
        "mdl.destroy_desc", "rt.free", "rt.destroy_context", "rt.reset_device", "finalize",
    ]  # fmt: skip
    assert [first[n] for n in expected] == sorted(first[n] for n in expected)
    assert fake.calls.index("mdl.get_cur_output_dims") > fake.calls.index("mdl.execute")


@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_outputs_equal_a_direct_onnxruntime_run(fake, dynamic_om, n):
    inputs = feeds(n, seed=n)
    with AclExecutor(str(dynamic_om), acl_module=fake) as ex:
        got = ex.run(inputs)
    want = reference(inputs)
    assert got["y"].shape == (n, 3) and got["ids2"].dtype == np.int32
    np.testing.assert_array_equal(got["y"], want["y"])
    np.testing.assert_array_equal(got["ids2"], want["ids2"])


def test_batch_3_runs_on_gear_4_and_returns_3_rows(fake, dynamic_om):
    with AclExecutor(str(dynamic_om), acl_module=fake) as ex:
        out = ex.run(feeds(3))
    assert fake.executed_batches == [4]
    assert out["y"].shape == (3, 3) and out["ids2"].shape == (3, 2)


def test_batch_larger_than_the_biggest_gear_is_split(fake, dynamic_om):
    inputs = feeds(19, seed=7)
    with AclExecutor(str(dynamic_om), acl_module=fake) as ex:
        out = ex.run(inputs)
    assert fake.executed_batches == [8, 8, 4]
    np.testing.assert_array_equal(out["y"], reference(inputs)["y"])


def test_device_buffers_are_allocated_once_and_reused(fake, dynamic_om):
    with AclExecutor(str(dynamic_om), acl_module=fake) as ex:
        ex.run(feeds(1))
        allocated = fake.malloc_count
        buffers = fake.leaks()["data_buffers"]
        for i in range(25):
            ex.run(feeds(1 + i % 8, seed=i))
        assert fake.malloc_count == allocated == 5  # x, ids, the batch-size input, y, ids2
        assert fake.leaks()["data_buffers"] == buffers


def test_close_releases_everything_and_is_idempotent(fake, dynamic_om):
    ex = AclExecutor(str(dynamic_om), acl_module=fake)
    ex.run(feeds(4))
    ex.close()
    ex.close()
    assert fake.leaks() == dict.fromkeys(fake.leaks(), 0)
    assert fake.calls.count("finalize") == 1
    with pytest.raises(ExecutorError, match="closed"):
        ex.run(feeds(1))


def test_two_executors_share_one_init_and_the_last_finalizes(fake, dynamic_om):
    a = AclExecutor(str(dynamic_om), acl_module=fake)
    b = AclExecutor(str(dynamic_om), acl_module=fake)
    assert fake.calls.count("init") == 1
    a.close()
    assert fake.initialized and "finalize" not in fake.calls
    np.testing.assert_array_equal(b.run(feeds(2))["y"], reference(feeds(2))["y"])
    b.close()
    assert fake.leaks() == dict.fromkeys(fake.leaks(), 0)


def test_runtime_initialized_elsewhere_is_left_running(fake, dynamic_om):
    fake.init()  # someone else in the process owns the runtime: our init answers 100002
    with AclExecutor(str(dynamic_om), acl_module=fake) as ex:
        ex.run(feeds(1))
    assert fake.initialized and "finalize" not in fake.calls
    assert fake.leaks()["allocations"] == 0


def test_static_model_runs_without_dynamic_batch_calls(fake, static_om):
    inputs = feeds(2)
    with AclExecutor(str(static_om), acl_module=fake) as ex:
        assert ex.max_batch_size == 0 and ex.inputs[0].shape == (2, 4)
        out = ex.run(inputs)
    assert "mdl.set_dynamic_batch_size" not in fake.calls
    np.testing.assert_array_equal(out["y"], reference(inputs)["y"])


@pytest.mark.parametrize(
    "call,code,text",
    [
        ("init", 100001, "acl.init failed with error 100001"),
        (
            "rt.set_device",
            107001,
            "acl.rt.set_device failed with error 107001 (ACL_ERROR_RT_INVALID_DEVICEID",
        ),
        ("rt.create_context", 107002, "acl.rt.create_context failed with error 107002"),
        (
            "mdl.load_from_file",
            100013,
            "acl.mdl.load_from_file failed with error 100013 (ACL_ERROR_PARSE_MODEL",
        ),
        ("mdl.get_desc", 100011, "acl.mdl.get_desc failed with error 100011"),
        ("mdl.get_dynamic_batch", 100000, "acl.mdl.get_dynamic_batch failed with error 100000"),
        ("rt.malloc", 207001, "acl.rt.malloc failed with error 207001 (ACL_ERROR_RT_MEMORY_ALLOCATION"),
        ("mdl.add_dataset_buffer", 100000, "acl.mdl.add_dataset_buffer failed with error 100000"),
        ("mdl.get_input_dims", 100000, "acl.mdl.get_input_dims failed with error 100000"),
    ],
)
def test_setup_errors_name_the_call_and_leave_nothing_behind(fake, dynamic_om, call, code, text):
    fake.inject[call] = code
    with pytest.raises(AclError) as exc:
        AclExecutor(str(dynamic_om), acl_module=fake)
    assert text in str(exc.value)
    assert exc.value.call == "acl." + call and exc.value.code == code
    assert fake.leaks() == dict.fromkeys(fake.leaks(), 0)


@pytest.mark.parametrize(
    "call,code",
    [
        ("rt.memcpy", 100000),
        ("mdl.set_dynamic_batch_size", 100019),
        ("mdl.execute", 507011),
        ("mdl.get_cur_output_dims", 100000),
    ],
)
def test_run_errors_name_the_call_and_the_executor_stays_usable(fake, dynamic_om, call, code):
    with AclExecutor(str(dynamic_om), acl_module=fake) as ex:
        fake.inject[call] = code
        with pytest.raises(AclError) as exc:
            ex.run(feeds(3))
        assert str(exc.value).startswith(f"acl.{call} failed with error {code}")
        np.testing.assert_array_equal(ex.run(feeds(3))["y"], reference(feeds(3))["y"])


def test_teardown_error_is_reported_after_releasing_the_rest(fake, dynamic_om):
    ex = AclExecutor(str(dynamic_om), acl_module=fake)
    fake.inject["mdl.unload"] = 100011
    with pytest.raises(AclError, match="acl.mdl.unload failed with error 100011"):
        ex.close()
    leaks = fake.leaks()
    assert leaks["allocations"] == leaks["contexts"] == leaks["devices"] == leaks["initialized"] == 0


def test_missing_model_file_is_invalid_file(fake, tmp_path):
    with pytest.raises(AclError, match="100003.*missing.om"):
        AclExecutor(str(tmp_path / "missing.om"), acl_module=fake)
    assert fake.leaks() == dict.fromkeys(fake.leaks(), 0)


def test_bad_device_id_is_reported_with_the_device(fake, dynamic_om):
    with pytest.raises(AclError, match="107001.*device 5"):
        AclExecutor(str(dynamic_om), device_id=5, acl_module=fake)


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"x": np.zeros((2, 4), np.float64), "ids": np.zeros((2, 2), np.int32)}, "float64"),
        ({"x": np.zeros((2, 5), np.float32), "ids": np.zeros((2, 2), np.int32)}, "shape"),
        ({"x": np.zeros((2, 4), np.float32)}, "missing input 'ids'"),
        ({"x": np.zeros((2, 4), np.float32), "ids": np.zeros((3, 2), np.int32)}, "batch 3"),
    ],
)
def test_bad_feeds_are_rejected_before_touching_the_device(fake, dynamic_om, bad, message):
    with AclExecutor(str(dynamic_om), acl_module=fake) as ex:
        before = len(fake.calls)
        with pytest.raises(ExecutorError, match=message):
            ex.run(bad)
        assert fake.calls[before:] == []


def test_fake_enforces_call_order_with_real_codes(fake, dynamic_om):
    assert fake.rt.malloc(16, 0) == (0, 100001)  # before init
    fake.init()
    assert fake.init() == 100002
    assert fake.rt.malloc(16, 0) == (0, 107002)  # no device/context yet
    assert fake.mdl.execute(1, 0, 0) == 107002
    fake.rt.set_device(0)
    assert fake.mdl.execute(1, 0, 0) == 100011  # nothing loaded
    assert fake.mdl.load_from_file("/nonexistent.om") == (0, 100003)


def test_missing_runtime_gives_a_readable_error(dynamic_om, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_acl(name, *args, **kwargs):
        if name == "acl":
            raise ImportError("No module named 'acl'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_acl)
    with pytest.raises(ExecutorError, match="set_env.sh"):
        AclExecutor(str(dynamic_om))
