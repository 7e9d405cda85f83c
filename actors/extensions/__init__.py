"""The plugins a role runs, in Slipstream's own types: `points` says what each kind of plugin is, `load` builds them
from the run's settings. slime's plugins are converted in `load` (through `actors.slime_compat`), so the roles call
our types only and never see slime's calling conventions."""
