"""Plugins users copy from: environments, rollout functions and rewards, loaded by dotted path.

slime's plugins are named ``examples.<example>.<module>`` too (its checkout root on the path, as its run scripts
set it): every ``examples`` folder on ``sys.path`` when this package is first imported is part of it, ours first,
so ``examples.multi_agent`` comes from a slime checkout while ``examples.slime_style`` stays ours.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
