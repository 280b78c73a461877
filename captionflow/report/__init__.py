"""What a run shows a person: the Markdown report and the leaderboard (markdown.py), report.html (html.py)."""
