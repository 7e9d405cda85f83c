"""The one-command check of a GPU machine (what runs, how fast), for the sessions that are lent one."""
