"""Device rules read from the source (AST; nothing runs): what a GPU run needs of every line.

(a) Every ``torch.tensor/zeros/empty/arange/full/ones`` in ``dp/``, ``comm/`` and ``pipeline/``
    names its ``device=``: without it the tensor lands on the CPU, and NCCL takes CUDA tensors
    only (and a CPU tensor beside CUDA ones is a silent host round trip). Exceptions are
    listed below, each with its reason.
(b) ``monitored_barrier`` only in the gloo branch of ``comm/groups.py``: it raises
    ``ValueError`` on every other backend.
(c) No host sync (``.item()``, ``.tolist()``, ``.nonzero()``, ``torch.nonzero``, one-argument
    ``torch.where``, ``host_list``) in the functions that make up a steady-state training
    step, listed below; exceptions listed with their reasons. (``bool(tensor)`` and
    ``float(tensor)`` cannot be told from ``bool(flag)`` by reading; the device-conformance
    tests on ``meta`` catch those.)

To allow an exception, add a line to the table of its rule, with the reason in a few words.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "syncline"

# -- (a) tensor factories without device= ---------------------------------------------------
FACTORIES = {"tensor", "zeros", "empty", "arange", "full", "ones"}
SCANNED = ("dp", "comm", "pipeline")

#: (file under syncline/, enclosing function, factory) -> why no device= is right there, e.g.
#: ("comm/x.py", "Thing.method", "zeros"): "host scratch for ..., never handed to torch.distributed"
NO_DEVICE_OK: dict[tuple[str, str, str], str] = {}

# -- (c) the steady-state step ---------------------------------------------------------------
#: file under syncline/ -> the functions (Class.method) run in every training step
STEADY_STATE: dict[str, tuple[str, ...]] = {
    # data parallelism: the reducer's hooks and launch path, the buffer, the forward. Not
    # listed, as they read on the host by design, never in a steady step of a default run:
    # Reducer.rebuild_from_observed_order (the first step only), BucketTuning (the tuning
    # steps only), Reducer._restore_globally_unused / _sent_by_error_feedback
    # (find_unused_parameters: which gradients become None is a host decision).
    "dp/reducer.py": (
        "Reducer.on_output_grad",
        "Reducer._begin_backward",
        "Reducer.on_grad_ready",
        "Reducer.on_sparse_ready",
        "Reducer._prepare",
        "Reducer.in_flight",
        "Reducer.begin_forward",
        "Reducer.watch_outputs",
        "Reducer.finish_backward",
        "Reducer._stays_open",
        "Reducer._flush_unready",
        "Reducer._reduce_sparse",
    ),
    "dp/launches.py": (
        "BucketLaunches.begin",
        "BucketLaunches.final",
        "BucketLaunches.start_complete",
        "BucketLaunches.start_rest",
        "BucketLaunches._start",
    ),
    "dp/layout.py": (
        "GradBuffer.gather_bucket",
        "GradBuffer.zero_missing",
        "GradBuffer.rebind",
        "GradBuffer.attach_grads",
        "GradBuffer.adopt",
        "GradBuffer.bucket",
    ),
    "dp/engine.py": ("DataParallel.forward", "DataParallel._sync_buffers"),
    "dp/placement.py": ("moved_to",),
    "dp/compression.py": ("NoCompression.reduce",),
    "dp/precision.py": ("unscale_and_flag",),
    # the non-finite guard: observed per bucket, agreed in the allreduce, the optimizer
    # skipping on the device (the host reads the verdict a step late, in train/guarding.py)
    "dp/guard.py": (
        "StepGuard.watch_loss",
        "StepGuard.begin",
        "StepGuard.observe",
        "StepGuard.fill_tail",
        "StepGuard.settle",
        "StepGuard.skip_flag",
    ),
    "optim/skip.py": ("step_unless", "fused_capable", "_params", "_tensor_state", "_plain_state"),
    # the compressors' reduce / compress / decompress paths
    "dp/compressors/halfwidth.py": ("_HalfWidth.reduce",),
    "dp/compressors/csc.py": (
        "CSC.reduce",
        "CSC._accumulate",
        "CSC._budget",
        "CSC._to_wire",
        "CSC.poll",
        "CSC._dense_fp32",
    ),
    "dp/compressors/chunks.py": (
        "chunk_scores",
        "select_chunks",
        "_body_tail",
        "pack_chunks",
        "zero_chunks",
        "put_chunks",
        "unpack_chunks",
        "element_mask",
        "pack",
        "unpack",
    ),
    "dp/compressors/topk.py": (
        "TopK.reduce",
        "TopK._residual",
        "TopK._scratch_for",
        "top_indices",
        "_pack",
        "_unpack",
    ),
    "dp/compressors/powersgd.py": (
        "PowerSGD.reduce",
        "PowerSGD.poll",
        "PowerSGD._dense",
        "PowerSGD._state",
        "_p",
        "_q",
    ),
    "dp/compressors/_pending.py": (
        "chain",
        "PhaseOrder.single",
        "PhaseOrder.poll",
        "PhaseOrder.submit",
        "PhaseOrder._advance_all",
        "PhaseOrder._advance",
    ),
    # the collectives every step goes through
    "comm/collectives.py": (
        "Pending.wait",
        "Pending.is_done",
        "FlatAllreduce.allreduce",
        "FlatAllreduce.allgather",
        "PackedBroadcast.start",
    ),
    # the pipeline's action handlers and what they call per micro-batch
    "pipeline/actions.py": (
        "recv",
        "_received",
        "_outgoing",
        "send",
        "issue",
        "forward",
        "recompute",
        "backward",
        "reduce",
        "step",
        "broadcast_loss",
    ),
    "pipeline/calls.py": ("CallRunner.run",),
    "pipeline/stage.py": ("Stage.forward", "Stage.backward", "Stage.recompute", "Stage.step"),
    "pipeline/links.py": (
        "Links.recv",
        "Links.send",
        "Links.progress",
        "Links.send_loss",
        "Links.recv_loss",
        "Links.wait_sends",
    ),
    "pipeline/packets.py": (
        "Single.pack",
        "Single.unpack",
        "Single.pack_grads",
        "Single.unpack_grads",
        "Packed.pack",
        "Packed.unpack",
        "Packed.pack_grads",
        "Packed.unpack_grads",
        "Packed._join",
        "Packed._split",
    ),
    "pipeline/reduce_buckets.py": (
        "BucketedReduce._for",
        "BucketedReduce.arm",
        "BucketedReduce._hook",
        "BucketedReduce.reduce",
    ),
    "pipeline/replicas.py": (
        "StageReplicas.arm",
        "StageReplicas.reduce",
        "StageReplicas.average_loss",
    ),
    "pipeline/tied.py": ("TiedGradients.sum",),
}

#: (file, function, what) -> why this host read belongs in the step anyway
#: (Sparse gradients need none here: the allgather algorithm, comm/collectives.py
#: _sparse_by_allgather, not listed above, reads the ranks' nnz to size its buffers, as gloo's
#: own does; the reducer only calls it, once per sparse parameter per step.)
HOST_SYNC_OK: dict[tuple[str, str, str], str] = {
    ("dp/compressors/topk.py", "top_indices", "torch.nonzero"): (
        "CPU tensors only: a device tensor takes torch.topk before it (memory the host holds)"
    ),
}

HOST_READS = {"item", "tolist", "nonzero"}


# -- the readers -----------------------------------------------------------------------------
def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function of a module with its qualified name (``Class.method``); a nested
    function is yielded too, under its own name, and also counted in its parent's body."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{prefix}{child.name}", child
                yield from walk(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    for name, fn in walk(tree, ""):
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        yield name, fn


def _enclosing(tree: ast.Module) -> dict[ast.AST, str]:
    """Each node -> the qualified name of the innermost function holding it ('' at top)."""
    owner: dict[ast.AST, str] = {}
    for name, fn in sorted(_functions(tree), key=lambda x: x[0].count(".")):
        for node in ast.walk(fn):
            owner[node] = name.split(".<locals>.")[0]
    return owner


def _parse(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(), filename=rel)


def _files(*dirs: str) -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for d in dirs for p in (ROOT / d).rglob("*.py"))


def _torch_factory(node: ast.AST) -> str | None:
    """``zeros`` for a call ``torch.zeros(...)``, else None."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    f = node.func
    if isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES:
        return f.attr
    return None


def test_tensor_factories_name_their_device() -> None:
    offenders = []
    for rel in _files(*SCANNED):
        tree = _parse(rel)
        owner = _enclosing(tree)
        for node in ast.walk(tree):
            factory = _torch_factory(node)
            if factory is None:
                continue
            assert isinstance(node, ast.Call)
            keywords = {k.arg for k in node.keywords}
            if "device" in keywords or None in keywords:  # device= or **kwargs
                continue
            key = (rel, owner.get(node, ""), factory)
            if key in NO_DEVICE_OK:
                continue
            offenders.append(
                f"syncline/{rel}:{node.lineno} {key[1] or '<module>'}: torch.{factory}"
            )
    assert offenders == [], "tensor factories without device=:\n" + "\n".join(offenders)


def test_no_device_allow_list_is_current() -> None:
    """Every exception still names a factory call without device= (else delete it)."""
    stale = []
    for (rel, fn, factory), _reason in NO_DEVICE_OK.items():
        tree = _parse(rel)
        owner = _enclosing(tree)
        hits = [
            n
            for n in ast.walk(tree)
            if _torch_factory(n) == factory
            and owner.get(n, "") == fn
            and isinstance(n, ast.Call)
            and not {k.arg for k in n.keywords} & {"device", None}
        ]
        if not hits:
            stale.append(f"{rel} {fn} torch.{factory}")
    assert stale == [], "stale NO_DEVICE_OK entries:\n" + "\n".join(stale)


# -- (b) ---------------------------------------------------------------------------------
def _in_gloo_branch(node: ast.AST, tree: ast.Module) -> bool:
    """Whether ``node`` lies in the body (not the else) of an ``if`` testing for gloo."""
    return any(
        isinstance(branch, ast.If)
        and "gloo" in ast.unparse(branch.test)
        and any(node is n for stmt in branch.body for n in ast.walk(stmt))
        for branch in ast.walk(tree)
    )


def test_monitored_barrier_only_in_the_gloo_branch_of_groups() -> None:
    offenders = []
    for rel in _files("."):
        tree = _parse(rel)
        for node in ast.walk(tree):
            named = (isinstance(node, ast.Attribute) and node.attr == "monitored_barrier") or (
                isinstance(node, ast.Name) and node.id == "monitored_barrier"
            )
            if not named:
                continue
            if rel == "comm/groups.py" and _in_gloo_branch(node, tree):
                continue
            offenders.append(f"syncline/{rel}:{node.lineno}")
    assert offenders == [], "monitored_barrier outside gloo's branch:\n" + "\n".join(offenders)


# -- (c) ---------------------------------------------------------------------------------
def _host_read(node: ast.AST) -> str | None:
    """``.item()``, ``.tolist()``, ``.nonzero()``, ``torch.nonzero``, ``torch.where(c)``,
    ``host_list(...)``: the name of the read, else None."""
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    if isinstance(f, ast.Attribute):
        if f.attr in HOST_READS:
            return f".{f.attr}()" if not _is_torch(f.value) else f"torch.{f.attr}"
        if f.attr == "where" and _is_torch(f.value) and len(node.args) == 1 and not node.keywords:
            return "torch.where(cond)"
        if f.attr == "host_list":
            return "host_list"
    if isinstance(f, ast.Name) and f.id == "host_list":
        return "host_list"
    return None


def _is_torch(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "torch"


def _steady_functions() -> Iterator[tuple[str, str, ast.AST | None]]:
    for rel, names in STEADY_STATE.items():
        path = ROOT / rel
        found = dict(_functions(_parse(rel))) if path.exists() else {}
        for name in names:
            yield rel, name, found.get(name)


def test_no_host_sync_in_the_steady_state_step() -> None:
    offenders = []
    for rel, name, fn in _steady_functions():
        if fn is None:
            continue  # reported by test_steady_state_list_is_current
        for node in ast.walk(fn):
            read = _host_read(node)
            if read is None or (rel, name, read) in HOST_SYNC_OK:
                continue
            offenders.append(f"syncline/{rel}:{node.lineno} {name}: {read}")
    assert offenders == [], "host syncs in the steady-state step:\n" + "\n".join(offenders)


def test_steady_state_list_is_current() -> None:
    """Every listed function exists (renamed or moved: update STEADY_STATE)."""
    missing = [f"syncline/{rel} {name}" for rel, name, fn in _steady_functions() if fn is None]
    assert missing == [], "STEADY_STATE names functions that are gone:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("x.item()", ".item()"),
        ("t.tolist()", ".tolist()"),
        ("m.nonzero()", ".nonzero()"),
        ("torch.nonzero(m)", "torch.nonzero"),
        ("torch.where(m)", "torch.where(cond)"),
        ("torch.where(m, a, b)", None),
        ("host_list(t, meta=[])", "host_list"),
        ("torch.zeros(3)", None),
    ],
)
def test_the_host_read_detector(source: str, expected: str | None) -> None:
    call = ast.parse(source, mode="eval").body
    assert _host_read(call) == expected


def test_the_factory_detector() -> None:
    calls = [ast.parse(s, mode="eval").body for s in ("torch.zeros(3)", "torch.zeros_like(x)")]
    assert [_torch_factory(c) for c in calls] == ["zeros", None]
