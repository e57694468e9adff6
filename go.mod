module github.com/cagehq/cage

go 1.26.8

require (
	connectrpc.com/connect v1.19.1
	google.golang.org/protobuf v1.36.12
)

require (
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/spf13/cobra v1.10.2 // indirect
	github.com/spf13/pflag v1.0.9 // indirect
	golang.org/x/term v0.48.0 // indirect
)

require (
	github.com/creack/pty v1.1.24 // indirect
	golang.org/x/sys v0.50.0
)
