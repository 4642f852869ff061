"""The role of each file a training framework writes, from its name alone (pure: no file is opened).

``optimizer.pt`` is training state, ``model.safetensors`` weights, ``trainer_state.json`` the trainer's
state ...  The formats use it to order the "a directory with no checkpoint in it" message (real
checkpoints before sidecars); :mod:`ckptfix.formats.layouts` to label every file of a framework folder.
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

#: (pattern, role) for every other file a framework writes; the first match names the role (compiled on first
#: use: importing this module is on the start-up of ``inspect``)
_ROLE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"optimizer(_\d+)?\.(pt|bin)|.*_optim_states\.pt", "optimizer"),
    (r"scheduler(_\d+)?\.(pt|bin)", "scheduler"),
    (r"rng_state(_\d+)?\.pth|random_states_\d+\.pkl", "rng"),
    (r"training_args\.bin", "args"),
    (r"trainer_state\.json", "trainer-state"),
    (r"config\.json", "config"),
    (r"generation_config\.json", "gen-config"),
    (r"sampler(_\d+)?\.bin", "sampler"),
    (r"scaler\.pt", "scaler"),
    (r"custom_checkpoint_\d+\.pkl", "custom"),
    (r"meta\.pt", "meta"),
    (r"model_\d+\.safetensors|pytorch_model_\d+\.bin", "model"),
    (r"(tokenizer|special_tokens_map|vocab|merges|added_tokens|chat_template).*", "tokenizer"),
    (r"adapter_config\.json", "adapter"),
    (r"README\.md|\.gitattributes", "other"),
)
_ROLES: list[tuple[re.Pattern[str], str]] | None = None


def _roles() -> list[tuple[re.Pattern[str], str]]:
    global _ROLES
    if _ROLES is None:  # (a whole list assigned at once: a thread never sees part of it)
        _ROLES = [(re.compile(p), role) for p, role in _ROLE_PATTERNS]
    return _ROLES


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
    for pat, role in _roles():
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
