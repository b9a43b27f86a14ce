"""SQL text shared by the Nexmark queries' batch references (nexmark_queries.py) and the PyFlink
arm (bench_nexmark_flink.py, which runs in its own virtualenv without PySpark): plain
strings, no imports."""

# q15 and q16's counts per price rank (Flink's FILTER clauses), the same text in Spark and Flink
RANK_SQL = """
          count(*) AS total_bids,
          count(*) FILTER (WHERE price < 10000) AS rank1_bids,
          count(*) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_bids,
          count(*) FILTER (WHERE price >= 1000000) AS rank3_bids,
          count(DISTINCT bidder) AS total_bidders,
          count(DISTINCT bidder) FILTER (WHERE price < 10000) AS rank1_bidders,
          count(DISTINCT bidder) FILTER (WHERE price >= 10000 AND price < 1000000)
            AS rank2_bidders,
          count(DISTINCT bidder) FILTER (WHERE price >= 1000000) AS rank3_bidders,
          count(DISTINCT auction) AS total_auctions,
          count(DISTINCT auction) FILTER (WHERE price < 10000) AS rank1_auctions,
          count(DISTINCT auction) FILTER (WHERE price >= 10000 AND price < 1000000)
            AS rank2_auctions,
          count(DISTINCT auction) FILTER (WHERE price >= 1000000) AS rank3_auctions"""
