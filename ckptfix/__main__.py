from ckptfix.cli import run

run()
