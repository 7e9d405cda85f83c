"""slime's own repository, read by `tools/slime_scripts.py`: its run scripts' command lines and tiny stand-ins."""
