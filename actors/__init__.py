from actors.moved import install as _answer_moved_module_names

_answer_moved_module_names()
