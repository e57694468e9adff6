// Command cage-interp is cage's code interpreter: the server on port 49999
// that @e2b/code-interpreter's runCode and code contexts talk to, inside a
// sandbox of the code-interpreter-v1 template (templates/code-interpreter).
// It is static (CGO_ENABLED=0) and runs as the sandbox's user; the
// template's start command is `cage-interp serve` and its ready check
// `cage-interp health`.
//
//	cage-interp serve [--addr 127.0.0.1:49999] [--cwd /home/user] [--max-contexts N] [--max-output BYTES]
//	cage-interp health [--addr 127.0.0.1:49999]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/cagehq/cage/internal/interp"
)

const defaultAddr = "127.0.0.1:49999"

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: cage-interp serve|health [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2:])
	case "health":
		err = health(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q (want serve or health)", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "cage-interp:", err)
		os.Exit(1)
	}
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	addr := fs.String("addr", defaultAddr, "address to listen on (the proxy reaches the sandbox's localhost)")
	cwd := fs.String("cwd", interp.DefaultCwd, "working directory of contexts that name none")
	maxContexts := fs.Int("max-contexts", interp.DefaultMaxContexts, "contexts alive at once")
	maxOutput := fs.Int64("max-output", interp.DefaultMaxOutput, "bytes of output one run may send")
	prestart := fs.String("prestart", "python", "language whose default context starts before /health answers (\"\": none)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	s := interp.New(interp.Config{Cwd: *cwd, MaxContexts: *maxContexts, MaxOutput: *maxOutput, Log: log})
	defer s.Close()
	l, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second, MaxHeaderBytes: 64 << 10}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	go func() {
		if *prestart != "" {
			s.Prestart(ctx, *prestart)
		} else {
			s.Prestart(ctx)
		}
	}()
	log.Info("serving", "addr", l.Addr().String())
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// health exits 0 once the server answers /health with 200: the template's
// ready check.
func health(args []string) error {
	fs := flag.NewFlagSet("health", flag.ContinueOnError)
	addr := fs.String("addr", defaultAddr, "the server's address")
	if err := fs.Parse(args); err != nil {
		return err
	}
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + *addr + "/health")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("not ready: %s %s", resp.Status, body)
	}
	return nil
}
