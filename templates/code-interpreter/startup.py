# Run by every Python kernel of cage's code interpreter at start
# (ipython_kernel_config.py): adds E2B's "e2b/data" MIME type, a pandas
# DataFrame as {column: [values]}, registered by name so that pandas is
# imported only by code that uses it. Leaves no names behind.


def _cage_setup():
    import math

    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    # Beyond this many cells a DataFrame gets its HTML and text only: the
    # data field would copy the whole frame into one message.
    max_cells = 1_000_000

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

    def plain(v):
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if hasattr(v, "isoformat"):
            return v.isoformat()
        if hasattr(v, "item"):  # a numpy scalar
            try:
                return plain(v.item())
            except Exception:
                pass
        return str(v)

    def dataframe(df):
        if df.size > max_cells:
            return None
        return {str(k): [plain(v) for v in vals] for k, vals in df.to_dict(orient="list").items()}

    ip = get_ipython()
    if ip is None:
        return
    f = DataFormatter(parent=ip.display_formatter)
    ip.display_formatter.formatters[f.format_type] = f
    f.for_type_by_name("pandas.core.frame", "DataFrame", dataframe)


_cage_setup()
del _cage_setup
