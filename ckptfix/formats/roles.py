"""The role of each file a training framework writes, from its name alone (pure: no file is opened).

``optimizer.pt`` is training state, ``model.safetensors`` weights, ``trainer_state.json`` the trainer's
state ...  The formats use it to order the "a directory with no checkpoint in it" message (real
checkpoints before sidecars); :mod:`ckptfix.layouts` to label every file of a framework folder.
"""

from __future__ import annotations

import re

#: model weight files a framework folder may hold, in the order they are preferred
WEIGHT_NAMES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)

#: (pattern, role) for every other file a framework writes; the first match names the role
_ROLES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"optimizer(_\d+)?\.(pt|bin)|.*_optim_states\.pt"), "optimizer"),
    (re.compile(r"scheduler(_\d+)?\.(pt|bin)"), "scheduler"),
    (re.compile(r"rng_state(_\d+)?\.pth|random_states_\d+\.pkl"), "rng"),
    (re.compile(r"training_args\.bin"), "args"),
    (re.compile(r"trainer_state\.json"), "trainer-state"),
    (re.compile(r"config\.json"), "config"),
    (re.compile(r"generation_config\.json"), "gen-config"),
    (re.compile(r"sampler(_\d+)?\.bin"), "sampler"),
    (re.compile(r"scaler\.pt"), "scaler"),
    (re.compile(r"custom_checkpoint_\d+\.pkl"), "custom"),
    (re.compile(r"meta\.pt"), "meta"),
    (re.compile(r"model_\d+\.safetensors|pytorch_model_\d+\.bin"), "model"),
    (re.compile(r"(tokenizer|special_tokens_map|vocab|merges|added_tokens|chat_template).*"), "tokenizer"),
    (re.compile(r"README\.md|\.gitattributes|adapter_config\.json"), "other"),
]

#: the roles whose files are training state around the weights (listed after real checkpoints)
SIDECAR_ROLES = frozenset({"optimizer", "scheduler", "rng", "args", "sampler", "scaler", "custom", "meta"})


def file_role(name: str) -> str | None:
    """The role of a file a framework writes, from its name.

    Args:
        name: the file name (no directory).

    Returns:
        ``"weights"``, ``"optimizer"``, ``"scheduler"``, ``"rng"``, ``"args"``, ``"trainer-state"``,
        ``"config"``, ... or None for a name no framework in :data:`LAYOUTS` writes.
    """
    if name in WEIGHT_NAMES or re.fullmatch(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)", name):
        return "weights"
    for pat, role in _ROLES:
        if pat.fullmatch(name):
            return role
    return None


def is_sidecar_name(name: str) -> bool:
    """Whether ``name`` is a framework's training-state file rather than model weights (``optimizer.pt``).

    Args:
        name: a file name.

    Returns:
        True for optimizer, scheduler, RNG, arguments, sampler, custom-object and Lightning meta files.
    """
    return file_role(name) in SIDECAR_ROLES
