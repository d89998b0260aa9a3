"""DeepSpeed names zerotron does not serve, and why: the *refused* rows of docs/deepspeed.md.

A script that reaches one is told so, with what to use instead, rather than Python's bare
"has no attribute" or "No module named". Reading a missing attribute raises an
``AttributeError`` with the reason (``hasattr`` and ``getattr(obj, name, default)`` still
answer False and the default); importing a missing module raises a ``ModuleNotFoundError``
with it (``try: import ... except ImportError:`` still falls back). Some refused names exist
and raise when used instead (``deepspeed.moe.layer.MoE``): they are listed so the table is the
doc's, and are never looked up. tests/test_deepspeed_doc.py keeps this table equal to the doc.
It sits in ``config``, beside DeepSpeed's config table, because the engine and ZeRO (layers
below ``compat``) raise from it too.
"""

from __future__ import annotations

_INJECTION = (
    "DeepSpeed-Inference's kernel injection does not exist in zerotron; generate with "
    "`zerotron generate` or `zerotron.inference.generate`"
)
_FUSED_LAYER = (
    "DeepSpeed's fused CUDA transformer kernel; build the model with zerotron's GPT or "
    "plain torch layers"
)
_CONFIG_CLASS = (
    "DeepSpeed's parsed-config class; the engine answers the same questions "
    "(`engine.config`, `engine.train_batch_size()`, `engine.zero_optimization_stage()`)"
)
_OBJECTS = (
    "object collectives unpickle what peers send; use tensors (zerotron never unpickles "
    "untrusted input)"
)
_COMMS_LOGGER = (
    "DeepSpeed's comms logger; zerotron's ledger (`zerotron.distributed.comm.ledger`) "
    "records every call's bytes instead"
)
_MICS = "MiCS and tiled linears do not exist in zerotron; use `zero.Init` and plain `nn.Linear`"
_OFFLOAD_STATES = (
    "`DeepSpeedEngine.offload_states` / `reload_states` do not exist in zerotron; ZeRO's "
    "`offload_optimizer` and `offload_param` keep states on the host throughout"
)

REFUSED: dict[str, str] = {
    "deepspeed.init_inference": _INJECTION,
    "deepspeed.module_inject": _INJECTION,
    "deepspeed.replace_transformer_layer": _INJECTION,
    "deepspeed.tp_model_init": (
        "AutoTP of arbitrary HF models does not exist; zerotron's tensor parallelism is its"
        " GPT's (`--tensor-model-parallel-size`)"
    ),
    "deepspeed.DeepSpeedTransformerLayer": _FUSED_LAYER,
    "deepspeed.DeepSpeedTransformerConfig": _FUSED_LAYER,
    "deepspeed.DeepSpeedConfig": _CONFIG_CLASS,
    "deepspeed.runtime.config.DeepSpeedConfig": _CONFIG_CLASS,
    "deepspeed.comm.all_gather_object": _OBJECTS,
    "deepspeed.comm.broadcast_object_list": _OBJECTS,
    "deepspeed.comm.log_summary": _COMMS_LOGGER,
    "deepspeed.comm.configure": _COMMS_LOGGER,
    "deepspeed.zero.MiCS_Init": _MICS,
    "deepspeed.zero.TiledLinear": _MICS,
    "deepspeed.runtime.zero.offload_config": _OFFLOAD_STATES,
    "deepspeed.DeepSpeedEngine.offload_states": _OFFLOAD_STATES,
    "deepspeed.DeepSpeedEngine.reload_states": _OFFLOAD_STATES,
    "deepspeed.runtime.pipe.topology.PipeDataParallelTopology": (
        "zerotron's `ProcessTopology(tp=, dp=, pp=)` takes other arguments; "
        "`PipelineModule(num_stages=N)` lays out pipe \u00d7 data itself"
    ),
    "deepspeed.runtime.config.ONEBIT_LAMB_OPTIMIZER": (
        '1-bit LAMB is gone from DeepSpeed 0.19 and does not exist in zerotron; use `"Lamb"`'
    ),
    "deepspeed.runtime.data_pipeline": (
        "DeepSpeed's data-efficiency library (curriculum learning, random-LTD, data "
        "sampling and analysis) does not exist in zerotron; feed the engine your own data "
        "loader"
    ),
    "deepspeed.runtime.sequence_parallel": (
        "DeepSpeed's Ulysses sequence parallelism for HF models (accelerate's ALST) does "
        "not exist in zerotron; its sequence parallelism is Megatron's, for zerotron's GPT "
        "(`--sequence-parallel`)"
    ),
    "deepspeed.launcher.runner": (
        "DeepSpeed's launcher CLI; start jobs with `zerotron launch` (hostfile, "
        "`--include`/`--exclude`, `.deepspeed_env`: docs/launch.md)"
    ),
    "deepspeed.runtime.domino": (
        "Domino's overlapped tensor parallelism does not exist in zerotron; use zerotron's "
        "tensor parallelism (`--tensor-model-parallel-size`)"
    ),
    "deepspeed.DeepSpeedEngine.compile": (
        "torch.compile of the wrapped model is not wired through the engine; compile the "
        "model before `initialize`"
    ),
    "deepspeed.ops.lamb.FusedLamb": 'not provided; the config\'s `"Lamb"` optimizer is',
    "deepspeed.ops.transformer.DeepSpeedTransformerLayer": (
        "DeepSpeed's fused CUDA kernels; use zerotron's GPT"
    ),
    "deepspeed.ops.sparse_attention": (
        "DeepSpeed's block-sparse attention kernels (Triton, CUDA only) do not exist in "
        "zerotron; use dense attention"
    ),
    "deepspeed.moe.layer.MoE": (
        "importable, so scripts with an optional MoE path run; building one raises "
        "`UnsupportedError`: zerotron has no mixture-of-experts layer yet"
    ),
    "deepspeed.compression.compress.init_compression": (
        "DeepSpeed Compression does not exist in zerotron"
    ),
}


def refusal(name: str) -> str | None:
    """Why the DeepSpeed name ``name`` (``deepspeed.a.b``) is refused: its own entry or its
    nearest refused parent's (a refused module refuses everything in it); None if neither."""
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        why = REFUSED.get(".".join(parts[:end]))
        if why is not None:
            return why
    return None


def deepspeed_name(module: str) -> str:
    """The DeepSpeed name of a zerotron module: ``zerotron.compat.comm`` and ``zerotron.comm``
    are ``deepspeed.comm``, ``zerotron.zero`` is ``deepspeed.zero``, ``zerotron`` is
    ``deepspeed``."""
    parts = module.split(".")
    if parts[1:2] == ["compat"]:
        parts = parts[:1] + parts[2:]
    return ".".join(["deepspeed", *parts[1:]])


def missing_attribute(owner: str, attr: str, message: str) -> AttributeError:
    """The error for reading ``attr`` of the DeepSpeed object ``owner`` (``deepspeed.comm``,
    ``deepspeed.DeepSpeedEngine``) that is not there: ``message`` alone, or with the reason
    the name is refused."""
    name = f"{owner}.{attr}"
    why = refusal(name)
    if why is None:
        return AttributeError(message)
    return AttributeError(f"{name} is not served by zerotron: {why} (docs/deepspeed.md)")


def missing_module(name: str) -> ModuleNotFoundError | None:
    """The error for importing the DeepSpeed module ``name`` when it is refused, else None."""
    why = refusal(name)
    if why is None:
        return None
    return ModuleNotFoundError(
        f"{name} is not served by zerotron: {why} (docs/deepspeed.md)", name=name
    )
