# IPython's configuration for every Python kernel of cage's code interpreter
# (read from /etc/ipython by each kernel at start).
c = get_config()  # noqa: F821 (IPython defines it)

# Tracebacks without ANSI colour escapes: they reach the SDK as plain text.
c.InteractiveShell.colors = "NoColor"
# Sequences shown whole in text/plain, as E2B's kernels show them.
c.PlainTextFormatter.max_seq_length = 0
# E2B's extra MIME types (startup.py).
c.IPKernelApp.exec_files = ["/usr/local/share/cage-interp/startup.py"]
