from lucepy.cli import app

app(prog_name="lucepy")
