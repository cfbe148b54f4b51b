"""The two packages Lightning's Trainer comes in, and what the strategy takes from each.

The ``lightning`` package holds the Trainer as ``lightning.pytorch``; the standalone ``pytorch-lightning`` package holds
the same code as ``pytorch_lightning`` (its Fabric as ``lightning_fabric``), and both may be installed at once
(``lightning`` 2.6 installs the other). A Trainer accepts only strategies, launchers and callbacks derived from its own
package's classes, so the strategy is written once (:class:`lightning_pipe.strategy.GPipeStrategyMixin`) and made a
class of each installed package from that package's ``ParallelStrategy``
(:class:`lightning_pipe.strategy.GPipeStrategy`, :class:`lightning_pipe.standalone.GPipeStrategy`), each with what it
needs of its package in a :class:`LightningPackage`.

A strategy object takes the package of the Trainer that sets it up (:func:`adopt_package`): the
``GPipeStrategy(...)`` a project imports from ``lightning_pipe`` works under either Trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet

LIGHTNING = "lightning.pytorch"
STANDALONE = "pytorch_lightning"
# The releases of either package that the strategy works with: pyproject.toml's range for lightning.
LIGHTNING_RELEASES = SpecifierSet(">=2.4,<2.7")
_PREFIXES = {STANDALONE: ("pytorch_lightning.", "lightning_fabric."), LIGHTNING: ("lightning.",)}


@dataclass(frozen=True)
class LightningPackage:
    """What the strategy uses of one Lightning package, by role."""

    name: str  # LIGHTNING or STANDALONE
    strategy_class: type  # the gpipe strategy derived from this package's ParallelStrategy
    subprocess_launcher: type  # the launchers, derived from this package's
    multiprocessing_launcher: type
    possible_user_warning: type[Warning]
    torch_checkpoint_io: type
    forward_redirection: type


_packages: dict[str, LightningPackage] = {}


def register_package(package: LightningPackage) -> None:
    _packages[package.name] = package


def package_of(obj: Any) -> str | None:
    """The Lightning package ``obj``'s class comes from (through its bases), or ``None`` for neither."""
    for cls in type(obj).__mro__:
        for name, prefixes in _PREFIXES.items():
            if cls.__module__.startswith(prefixes):
                return name
    return None


def lightning_module_base(obj: Any) -> type | None:
    """The ``LightningModule`` class (of either package) that ``obj``'s class derives from, or ``None``."""
    for cls in type(obj).__mro__:
        if cls.__name__ == "LightningModule" and cls.__module__ in (f"{LIGHTNING}.core.module", f"{STANDALONE}.core.module"):
            return cls
    return None


def overrides(module: Any, hook: str) -> bool:
    """Whether the LightningModule ``module`` defines its own ``hook`` (``"configure_model"``)."""
    base = lightning_module_base(module)
    return base is not None and getattr(type(module), hook) is not getattr(base, hook)


def adopt_package(strategy: Any, part: Any) -> None:
    """Make ``strategy`` the gpipe strategy of the package that ``part`` (an accelerator the Trainer sets) comes from.

    The two classes share every method and attribute; only their Lightning base classes differ. A subclass of one
    cannot change package: it is refused, naming the class to derive from instead.
    """
    wanted, current = package_of(part), strategy.lightning_package
    if wanted is None or wanted == current.name:
        return
    if wanted not in _packages:
        raise TypeError(
            f"the Trainer comes from {wanted}, but lightning_pipe found no gpipe strategy for it; install"
            f" pytorch-lightning in the range lightning_pipe supports (as lightning), or use the Trainer of {current.name}"
        )
    if type(strategy) is not current.strategy_class:
        target = _packages[wanted].strategy_class
        raise TypeError(
            f"{type(strategy).__name__} derives from {current.strategy_class.__module__}.GPipeStrategy, a strategy"
            f" of {current.name}, but the Trainer comes from {wanted}: derive it from"
            f" {target.__module__}.GPipeStrategy instead"
        )
    target = _packages[wanted]
    strategy.__class__ = target.strategy_class
    strategy._forward_redirection = target.forward_redirection()
