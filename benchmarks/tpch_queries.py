"""TPC-H-shaped queries in dask, and the same queries in SQL for DuckDB.

Each query takes the tables as dask DataFrames read with ``dd.read_parquet``
from tpchgen-cli's files, as a user would: money stays ``decimal128`` and
dates stay ``date32`` (pyarrow-backed pandas columns), and they travel
through every shuffle method as such.  A query returns a small pandas frame
(aggregates, or the top rows), finished in pandas after ``compute`` where
TPC-H orders or limits the result.  ``SQL`` holds DuckDB's version of each;
:func:`compare` checks one against the other.

Which shuffles run is dask-expr's choice (broadcast for the one-partition
``nation`` and ``region``, hash joins otherwise); the shuffle method comes
from ``dask.config`` (``dataframe.shuffle.method``), set by the benchmark.
The last four entries are not TPC-H queries but the other users of a
shuffle (groupby ``split_out``, ``drop_duplicates(split_out=)``,
``set_index``, ``sort_values``) on ``lineitem``.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

Tables = dict[str, Any]


def _date(text: str) -> datetime.date:
    return datetime.date.fromisoformat(text)


def _revenue(df: Any) -> Any:
    return df.l_extendedprice * (1 - df.l_discount)


# -- lineitem x orders: the join alone ----------------------------------------


def _join_summary(df: pd.DataFrame) -> pd.DataFrame:
    # Every column of the join is an input of this function, so every column
    # travels through the shuffle (dask cannot project through it).
    return pd.DataFrame(
        {
            "rows": [len(df)],
            "sum_quantity": [float(df["l_quantity"].sum()) if len(df) else 0.0],
            "sum_totalprice": [float(df["o_totalprice"].sum()) if len(df) else 0.0],
            "sum_comment_length": [int(df["l_comment"].str.len().sum()) if len(df) else 0],
        }
    )


def join(t: Tables) -> pd.DataFrame:
    """lineitem x orders on the order key, every column of both."""
    joined = t["lineitem"].merge(t["orders"], left_on="l_orderkey", right_on="o_orderkey")
    meta = _join_summary(pd.DataFrame(columns=["l_quantity", "o_totalprice", "l_comment"]))
    parts = joined.map_partitions(_join_summary, meta=meta).compute()
    return parts.sum().to_frame().T


# -- TPC-H queries --------------------------------------------------------------


def q3(t: Tables) -> pd.DataFrame:
    c = t["customer"]
    o = t["orders"]
    li = t["lineitem"]
    c = c[c.c_mktsegment == "BUILDING"][["c_custkey"]]
    o = o[o.o_orderdate < _date("1995-03-15")][
        ["o_orderkey", "o_custkey", "o_orderdate", "o_shippriority"]
    ]
    li = li[li.l_shipdate > _date("1995-03-15")]
    li = li.assign(revenue=_revenue(li))[["l_orderkey", "revenue"]]
    j = c.merge(o, left_on="c_custkey", right_on="o_custkey")
    j = j.merge(li, left_on="o_orderkey", right_on="l_orderkey")
    g = j.groupby(["l_orderkey", "o_orderdate", "o_shippriority"]).revenue.sum().reset_index()
    out = g.compute()
    out = out.sort_values(["revenue", "o_orderdate"], ascending=[False, True]).head(10)
    return out[["l_orderkey", "revenue", "o_orderdate", "o_shippriority"]]


def q5(t: Tables) -> pd.DataFrame:
    r = t["region"]
    n = t["nation"].merge(r[r.r_name == "ASIA"], left_on="n_regionkey", right_on="r_regionkey")
    s = t["supplier"].merge(n, left_on="s_nationkey", right_on="n_nationkey")
    o = t["orders"]
    o = o[(o.o_orderdate >= _date("1994-01-01")) & (o.o_orderdate < _date("1995-01-01"))]
    j = t["customer"].merge(o, left_on="c_custkey", right_on="o_custkey")
    j = j.merge(t["lineitem"], left_on="o_orderkey", right_on="l_orderkey")
    # A join on two keys: the supplier and the customer are of the same nation.
    j = j.merge(s, left_on=["l_suppkey", "c_nationkey"], right_on=["s_suppkey", "s_nationkey"])
    j = j.assign(revenue=_revenue(j))
    out = j.groupby("n_name").revenue.sum().reset_index().compute()
    return out.sort_values("revenue", ascending=False).reset_index(drop=True)


def q9(t: Tables) -> pd.DataFrame:
    p = t["part"]
    p = p[p.p_name.str.contains("green")][["p_partkey"]]
    j = p.merge(t["lineitem"], left_on="p_partkey", right_on="l_partkey")
    j = j.merge(
        t["partsupp"], left_on=["l_suppkey", "l_partkey"], right_on=["ps_suppkey", "ps_partkey"]
    )
    j = j.merge(t["supplier"], left_on="l_suppkey", right_on="s_suppkey")
    j = j.merge(t["orders"], left_on="l_orderkey", right_on="o_orderkey")
    j = j.merge(t["nation"], left_on="s_nationkey", right_on="n_nationkey")
    # decimal128(38, 4) minus decimal128(31, 4) needs 39 digits, more than
    # decimal128 holds: the difference is taken in float64 (an Arrow cast).
    j = j.assign(
        o_year=j.o_orderdate.dt.year,
        amount=_revenue(j).astype("double[pyarrow]")
        - (j.ps_supplycost * j.l_quantity).astype("double[pyarrow]"),
    )
    out = j.groupby(["n_name", "o_year"]).amount.sum().reset_index().compute()
    out = out.rename(columns={"n_name": "nation", "amount": "sum_profit"})
    return out.sort_values(["nation", "o_year"], ascending=[True, False]).reset_index(drop=True)


def q10(t: Tables) -> pd.DataFrame:
    o = t["orders"]
    o = o[(o.o_orderdate >= _date("1993-10-01")) & (o.o_orderdate < _date("1994-01-01"))]
    li = t["lineitem"]
    li = li[li.l_returnflag == "R"]
    j = t["customer"].merge(o, left_on="c_custkey", right_on="o_custkey")
    j = j.merge(li, left_on="o_orderkey", right_on="l_orderkey")
    j = j.merge(t["nation"], left_on="c_nationkey", right_on="n_nationkey")
    j = j.assign(revenue=_revenue(j))
    keys = ["c_custkey", "c_name", "c_acctbal", "c_phone", "n_name", "c_address", "c_comment"]
    out = j.groupby(keys).revenue.sum().reset_index().compute()
    out = out.sort_values(["revenue", "c_custkey"], ascending=[False, True]).head(20)
    return out[["c_custkey", "c_name", "revenue", "c_acctbal", "n_name"]]


def q18(t: Tables) -> pd.DataFrame:
    li = t["lineitem"]
    quantity = li.groupby("l_orderkey").l_quantity.sum().reset_index()
    big = quantity[quantity.l_quantity > 300][["l_orderkey"]]
    o = t["orders"].merge(big, left_on="o_orderkey", right_on="l_orderkey", how="leftsemi")
    j = t["customer"].merge(o, left_on="c_custkey", right_on="o_custkey")
    j = j.merge(li, left_on="o_orderkey", right_on="l_orderkey")
    keys = ["c_name", "c_custkey", "o_orderkey", "o_orderdate", "o_totalprice"]
    out = j.groupby(keys).l_quantity.sum().reset_index().compute()
    out = out.sort_values(["o_totalprice", "o_orderdate"], ascending=[False, True]).head(100)
    return out.reset_index(drop=True)


def q21(t: Tables) -> pd.DataFrame:
    n = t["nation"]
    s = t["supplier"].merge(
        n[n.n_name == "SAUDI ARABIA"], left_on="s_nationkey", right_on="n_nationkey"
    )
    s = s[["s_suppkey", "s_name"]]
    o = t["orders"]
    o = o[o.o_orderstatus == "F"][["o_orderkey"]]
    li = t["lineitem"][["l_orderkey", "l_suppkey", "l_receiptdate", "l_commitdate"]]
    late = li[li.l_receiptdate > li.l_commitdate][["l_orderkey", "l_suppkey"]]
    # EXISTS another supplier on the order; NOT EXISTS another late supplier.
    suppliers = li.groupby("l_orderkey").l_suppkey.nunique().reset_index()
    multi = suppliers[suppliers.l_suppkey > 1][["l_orderkey"]]
    late_suppliers = late.groupby("l_orderkey").l_suppkey.nunique().reset_index()
    only_late = late_suppliers[late_suppliers.l_suppkey == 1][["l_orderkey"]]
    j = late.merge(s, left_on="l_suppkey", right_on="s_suppkey")
    j = j.merge(o, left_on="l_orderkey", right_on="o_orderkey")
    j = j.merge(multi, on="l_orderkey")
    j = j.merge(only_late, on="l_orderkey")
    out = j.groupby("s_name").size().rename("numwait").reset_index().compute()
    out = out.sort_values(["numwait", "s_name"], ascending=[False, True]).head(100)
    return out.reset_index(drop=True)


# -- the other users of a shuffle ----------------------------------------------


def _totals(df: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"rows": [len(df)], "sum_key": [int(df.iloc[:, 0].astype("int64").sum())]})


def _sorted_check(df: pd.DataFrame, column: str) -> pd.DataFrame:
    values = df[column].to_numpy()
    return pd.DataFrame(
        {
            "rows": [len(df)],
            "first": [values[0] if len(df) else np.iinfo(np.int64).max],
            "last": [values[-1] if len(df) else np.iinfo(np.int64).min],
            "sorted": [bool((np.diff(values) >= 0).all())],
        }
    )


def _sorted_result(parts: pd.DataFrame) -> pd.DataFrame:
    nonempty = parts[parts.rows > 0]
    ordered = bool(nonempty.sorted.all()) and bool(
        (nonempty["first"].to_numpy()[1:] >= nonempty["last"].to_numpy()[:-1]).all()
    )
    return pd.DataFrame({"rows": [int(parts.rows.sum())], "ordered": [ordered]})


def _group_totals(df: pd.DataFrame) -> pd.DataFrame:
    out = _totals(df)
    out["q"] = [float(df["l_quantity"].sum()) if len(df) else 0.0]
    return out


def groupby_split_out(t: Tables) -> pd.DataFrame:
    li = t["lineitem"]
    g = li.groupby("l_orderkey").l_quantity.sum(split_out=8).reset_index()
    meta = _group_totals(pd.DataFrame({"k": np.zeros(0, "int64"), "l_quantity": np.zeros(0)}))
    parts = g.map_partitions(_group_totals, meta=meta).compute()
    return pd.DataFrame(
        {
            "rows": [int(parts.rows.sum())],
            "sum_key": [int(parts.sum_key.sum())],
            "q": [parts.q.sum()],
        }
    )


def drop_duplicates(t: Tables) -> pd.DataFrame:
    li = t["lineitem"][["l_orderkey", "l_suppkey"]]
    d = li.drop_duplicates(split_out=8)
    meta = _totals(pd.DataFrame({"k": np.zeros(0, "int64")}))
    parts = d.map_partitions(_totals, meta=meta).compute()
    return pd.DataFrame({"rows": [int(parts.rows.sum())], "sum_key": [int(parts.sum_key.sum())]})


def set_index(t: Tables) -> pd.DataFrame:
    li = t["lineitem"]
    d = li.set_index("l_partkey").reset_index()
    meta = _sorted_check(pd.DataFrame({"l_partkey": np.zeros(0, "int64")}), "l_partkey")
    return _sorted_result(d.map_partitions(_sorted_check, "l_partkey", meta=meta).compute())


def sort_values(t: Tables) -> pd.DataFrame:
    li = t["lineitem"]
    d = li.sort_values("l_suppkey")
    meta = _sorted_check(pd.DataFrame({"l_suppkey": np.zeros(0, "int64")}), "l_suppkey")
    return _sorted_result(d.map_partitions(_sorted_check, "l_suppkey", meta=meta).compute())


QUERIES: dict[str, Callable[[Tables], pd.DataFrame]] = {
    "join": join,
    "q3": q3,
    "q5": q5,
    "q9": q9,
    "q10": q10,
    "q18": q18,
    "q21": q21,
    "groupby_split_out": groupby_split_out,
    "drop_duplicates": drop_duplicates,
    "set_index": set_index,
    "sort_values": sort_values,
}
#: Entries that are TPC-H queries (the performance goals are about these).
TPCH = ("join", "q3", "q5", "q9", "q10", "q18", "q21")

SQL: dict[str, str] = {
    "join": """
        SELECT count(*) AS rows, sum(l_quantity) AS sum_quantity,
               sum(o_totalprice) AS sum_totalprice,
               sum(length(l_comment)) AS sum_comment_length
        FROM lineitem JOIN orders ON l_orderkey = o_orderkey""",
    "q3": """
        SELECT l_orderkey, sum(l_extendedprice * (1 - l_discount)) AS revenue,
               o_orderdate, o_shippriority
        FROM customer, orders, lineitem
        WHERE c_mktsegment = 'BUILDING' AND c_custkey = o_custkey
          AND l_orderkey = o_orderkey AND o_orderdate < DATE '1995-03-15'
          AND l_shipdate > DATE '1995-03-15'
        GROUP BY l_orderkey, o_orderdate, o_shippriority
        ORDER BY revenue DESC, o_orderdate LIMIT 10""",
    "q5": """
        SELECT n_name, sum(l_extendedprice * (1 - l_discount)) AS revenue
        FROM customer, orders, lineitem, supplier, nation, region
        WHERE c_custkey = o_custkey AND l_orderkey = o_orderkey
          AND l_suppkey = s_suppkey AND c_nationkey = s_nationkey
          AND s_nationkey = n_nationkey AND n_regionkey = r_regionkey
          AND r_name = 'ASIA' AND o_orderdate >= DATE '1994-01-01'
          AND o_orderdate < DATE '1995-01-01'
        GROUP BY n_name ORDER BY revenue DESC""",
    "q9": """
        SELECT nation, o_year, sum(amount) AS sum_profit FROM (
            SELECT n_name AS nation, extract(year FROM o_orderdate) AS o_year,
                   l_extendedprice * (1 - l_discount) - ps_supplycost * l_quantity AS amount
            FROM part, supplier, lineitem, partsupp, orders, nation
            WHERE s_suppkey = l_suppkey AND ps_suppkey = l_suppkey
              AND ps_partkey = l_partkey AND p_partkey = l_partkey
              AND o_orderkey = l_orderkey AND s_nationkey = n_nationkey
              AND p_name LIKE '%green%')
        GROUP BY nation, o_year ORDER BY nation, o_year DESC""",
    "q10": """
        SELECT c_custkey, c_name, sum(l_extendedprice * (1 - l_discount)) AS revenue,
               c_acctbal, n_name
        FROM customer, orders, lineitem, nation
        WHERE c_custkey = o_custkey AND l_orderkey = o_orderkey
          AND o_orderdate >= DATE '1993-10-01' AND o_orderdate < DATE '1994-01-01'
          AND l_returnflag = 'R' AND c_nationkey = n_nationkey
        GROUP BY c_custkey, c_name, c_acctbal, c_phone, n_name, c_address, c_comment
        ORDER BY revenue DESC, c_custkey LIMIT 20""",
    "q18": """
        SELECT c_name, c_custkey, o_orderkey, o_orderdate, o_totalprice,
               sum(l_quantity) AS l_quantity
        FROM customer, orders, lineitem
        WHERE o_orderkey IN (SELECT l_orderkey FROM lineitem GROUP BY l_orderkey
                             HAVING sum(l_quantity) > 300)
          AND c_custkey = o_custkey AND o_orderkey = l_orderkey
        GROUP BY c_name, c_custkey, o_orderkey, o_orderdate, o_totalprice
        ORDER BY o_totalprice DESC, o_orderdate LIMIT 100""",
    "q21": """
        SELECT s_name, count(*) AS numwait
        FROM supplier, lineitem l1, orders, nation
        WHERE s_suppkey = l1.l_suppkey AND o_orderkey = l1.l_orderkey
          AND o_orderstatus = 'F' AND l1.l_receiptdate > l1.l_commitdate
          AND EXISTS (SELECT * FROM lineitem l2 WHERE l2.l_orderkey = l1.l_orderkey
                      AND l2.l_suppkey <> l1.l_suppkey)
          AND NOT EXISTS (SELECT * FROM lineitem l3 WHERE l3.l_orderkey = l1.l_orderkey
                          AND l3.l_suppkey <> l1.l_suppkey
                          AND l3.l_receiptdate > l3.l_commitdate)
          AND s_nationkey = n_nationkey AND n_name = 'SAUDI ARABIA'
        GROUP BY s_name ORDER BY numwait DESC, s_name LIMIT 100""",
    "groupby_split_out": """
        SELECT count(*) AS rows, sum(l_orderkey) AS sum_key, sum(q) AS q FROM (
            SELECT l_orderkey, sum(l_quantity) AS q FROM lineitem GROUP BY l_orderkey)""",
    "drop_duplicates": """
        SELECT count(*) AS rows, sum(l_orderkey) AS sum_key FROM (
            SELECT DISTINCT l_orderkey, l_suppkey FROM lineitem)""",
    "set_index": "SELECT count(*) AS rows, true AS ordered FROM lineitem",
    "sort_values": "SELECT count(*) AS rows, true AS ordered FROM lineitem",
}


def _plain(df: pd.DataFrame) -> pd.DataFrame:
    """Values comparable across engines: decimals and pyarrow numbers as float."""
    out = df.reset_index(drop=True).copy()
    for name in out.columns:
        column = out[name]
        if column.dtype == object and len(column) and not isinstance(column.iloc[0], str):
            try:
                out[name] = column.astype("float64")
                continue
            except (TypeError, ValueError):
                pass
        if pd.api.types.is_bool_dtype(column.dtype):
            out[name] = column.astype(bool)
        elif pd.api.types.is_numeric_dtype(column.dtype) or "decimal" in str(column.dtype):
            out[name] = column.astype("float64")
        elif "date" in str(column.dtype):
            out[name] = pd.to_datetime(column.astype(str))
        else:
            out[name] = column.astype(str)
    return out


def compare(name: str, ours: pd.DataFrame, duckdb_result: pd.DataFrame) -> None:
    """Raise ``AssertionError`` unless the query's result equals DuckDB's.

    Columns by name, rows in order (every query orders its result), numbers
    to a relative 1e-9 (dask sums decimals in another order than DuckDB).
    """
    a, b = _plain(ours), _plain(duckdb_result)
    a.columns = [str(c) for c in a.columns]
    b.columns = [str(c) for c in b.columns]
    assert list(a.columns) == list(b.columns), f"{name}: columns {a.columns} != {b.columns}"
    pd.testing.assert_frame_equal(a, b, check_dtype=False, rtol=1e-9, obj=name)


def duckdb_results(data: str, names: list[str]) -> dict[str, pd.DataFrame]:
    """Each query's result from DuckDB, reading the same Parquet files."""
    import duckdb

    con = duckdb.connect()
    for table in (
        "customer",
        "lineitem",
        "nation",
        "orders",
        "part",
        "partsupp",
        "region",
        "supplier",
    ):
        con.execute(
            f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{data}/{table}/*.parquet')"
        )
    return {name: con.execute(SQL[name]).df() for name in names}
