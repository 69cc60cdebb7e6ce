from bigclip.cli import exit_process, main

if __name__ == "__main__":
    exit_process(main())
