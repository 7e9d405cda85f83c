"""Plugins written in slime's style (slime's signatures; only the imports point at ``actors.slime_compat``)."""
