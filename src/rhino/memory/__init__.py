"""Memory planning after ROAM (pure Python, never imports torch): an operator order and an offset for
every intermediate tensor in one arena, minimising the peak. Works on plain data (``problem.py``)."""
