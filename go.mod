module github.com/cagehq/cage

go 1.26.8

require (
	connectrpc.com/connect v1.19.1
	github.com/spf13/cobra v1.10.2
	golang.org/x/term v0.48.0
	google.golang.org/protobuf v1.36.12
)

require (
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/spf13/pflag v1.0.9 // indirect
)

require (
	github.com/creack/pty v1.1.24
	golang.org/x/sys v0.50.0
)
