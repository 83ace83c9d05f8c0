"""`d3d train --config FILE.yaml`: a flat mapping whose keys are the flags of `d3d train`
(with dashes or underscores: `max-steps` and `max_steps` are one key). Flags given on the
command line override the file; a key that is no flag is refused, naming it."""

from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A config file that cannot be used; the message is one line naming the cause."""


def normalise(key: str) -> str:
    return str(key).strip().lstrip("-").replace("-", "_")


def read_config_file(path: str | Path, known: set[str],
                     aliases: dict[str, str] | None = None) -> dict:
    """{field name: value as written} of a YAML mapping; ConfigError on an unknown key.
    aliases: other flag names of a field (`target` for `target_path`)."""
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping of flag names to values")
    out = {}
    for key, value in raw.items():
        name = normalise(key)
        name = (aliases or {}).get(name, name)
        if name not in known:
            raise ConfigError(f"{path}: unknown key {key!r} (keys are the flags of d3d train)")
        out[name] = value
    return out
