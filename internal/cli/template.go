package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/cagehq/cage/internal/build"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/units"
)

// dataDir is where cage keeps what outlives a run (templates, the daemon's
// database): $CAGE_DATA or /var/lib/cage.
func dataDir(flag string) string {
	if flag != "" {
		return flag
	}
	return envOr("CAGE_DATA", "/var/lib/cage")
}

// openTemplates opens the template store: $CAGE_TEMPLATES, or the one of
// the data directory.
func openTemplates(data string) (*imgstore.Store, error) {
	dir := filepath.Join(dataDir(data), "templates")
	if v := os.Getenv("CAGE_TEMPLATES"); v != "" && data == "" {
		dir = v
	}
	st, err := imgstore.Open(dir)
	if err != nil {
		return nil, exitf(ExitInternal, "open the template store in %s: %v", dir, err)
	}
	return st, nil
}

// templateErr maps the store's errors to exit codes.
func templateErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, imgstore.ErrNotFound):
		return exitf(ExitNoTemplate, "%v", err)
	case errors.Is(err, imgstore.ErrInvalid):
		return exitf(ExitUsage, "%v", err)
	case errors.Is(err, imgstore.ErrInUse):
		return exitf(ExitUsage, "%v", err)
	}
	var ee *exitError
	if errors.As(err, &ee) {
		return err
	}
	return exitf(ExitInternal, "%v", err)
}

func newTemplateCmd(g *globals) *cobra.Command {
	var data string
	var asJSON bool
	cmd := &cobra.Command{Use: "template", Short: "Manage templates: ls | inspect | rm | import | pull | export | gc"}
	cmd.PersistentFlags().StringVar(&data, "data", "", "state directory holding the template store in templates/ (default: $CAGE_TEMPLATES as the store, else $CAGE_DATA or /var/lib/cage)")
	withStore := func(f func(cmd *cobra.Command, st *imgstore.Store, args []string) error) func(*cobra.Command, []string) error {
		return func(cmd *cobra.Command, args []string) error {
			if os.Geteuid() != 0 {
				return exitf(ExitNoPerm, "cage template needs root (the store is root's)")
			}
			st, err := openTemplates(data)
			if err != nil {
				return err
			}
			return templateErr(f(cmd, st, args))
		}
	}
	progress := func(cmd *cobra.Command) func(string, ...any) {
		return func(format string, args ...any) {
			fmt.Fprintf(cmd.ErrOrStderr(), format+"\n", args...)
		}
	}
	ls := &cobra.Command{
		Use: "ls", Short: "List templates", Args: cobra.NoArgs,
		RunE: withStore(func(cmd *cobra.Command, st *imgstore.Store, _ []string) error {
			list, err := st.List()
			if err != nil {
				return err
			}
			if asJSON {
				if list == nil {
					list = []imgstore.Template{}
				}
				return printJSON(cmd.OutOrStdout(), list)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tID\tLAYERS\tSIZE\tCREATED\tSOURCE")
			fmt.Fprintln(tw, "host\t-\t-\t-\t-\tbuilt in: this host's /usr and a minimal /etc, read-only")
			for _, t := range list {
				fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", termSafe(t.Name), termSafe(shortID(t.ID)), len(t.Layers), units.HumanSize(t.Size),
					t.Created.Format(time.RFC3339), termSafe(t.Source))
			}
			return tw.Flush()
		}),
	}
	inspect := &cobra.Command{
		Use: "inspect NAME", Short: "Show a template as JSON", Args: cobra.ExactArgs(1),
		RunE: withStore(func(cmd *cobra.Command, st *imgstore.Store, args []string) error {
			t, err := st.Get(args[0])
			if err != nil {
				return err
			}
			type inspected struct {
				imgstore.Template
				InUse []string `json:"inUse"`
			}
			users := imgstore.InUse(t)
			if users == nil {
				users = []string{}
			}
			return printJSON(cmd.OutOrStdout(), inspected{*t, users})
		}),
	}
	rm := &cobra.Command{
		Use: "rm NAME...", Short: "Remove templates (not while a sandbox uses one)", Args: cobra.MinimumNArgs(1),
		RunE: withStore(func(cmd *cobra.Command, st *imgstore.Store, args []string) error {
			for _, name := range args {
				if err := st.Remove(name); err != nil {
					return err
				}
				fmt.Fprintln(cmd.OutOrStdout(), name)
			}
			return nil
		}),
	}
	var insecure bool
	var maxBytes string
	options := func(cmd *cobra.Command) (imgstore.Options, error) {
		o := imgstore.Options{Insecure: insecure, Progress: progress(cmd)}
		if maxBytes != "" {
			n, err := units.ParseSize(maxBytes)
			if err != nil {
				return o, exitf(ExitUsage, "--max-size: %v", err)
			}
			o.MaxBytes = n
		}
		return o, nil
	}
	imp := &cobra.Command{
		Use:   "import PATH NAME",
		Short: "Import an image: a `docker save` tarball or an OCI image layout (directory or tar)",
		Args:  cobra.ExactArgs(2),
		RunE: withStore(func(cmd *cobra.Command, st *imgstore.Store, args []string) error {
			o, err := options(cmd)
			if err != nil {
				return err
			}
			if _, err := os.Stat(args[0]); err != nil {
				return exitf(ExitUsage, "%s: %v", args[0], errors.Unwrap(err))
			}
			t, err := st.Import(ctxOf(cmd), args[0], args[1], o)
			if err != nil {
				return err
			}
			return printImported(cmd.OutOrStdout(), t)
		}),
	}
	pull := &cobra.Command{
		Use:   "pull REFERENCE NAME",
		Short: "Pull an image from an OCI registry (e.g. registry.example.com/team/python:3.12)",
		Args:  cobra.ExactArgs(2),
		RunE: withStore(func(cmd *cobra.Command, st *imgstore.Store, args []string) error {
			o, err := options(cmd)
			if err != nil {
				return err
			}
			t, err := st.Pull(ctxOf(cmd), args[0], args[1], o)
			if err != nil {
				return err
			}
			return printImported(cmd.OutOrStdout(), t)
		}),
	}
	for _, c := range []*cobra.Command{imp, pull} {
		c.Flags().StringVar(&maxBytes, "max-size", "", "refuse an image larger than this uncompressed (default 16G)")
	}
	pull.Flags().BoolVar(&insecure, "insecure", false, "allow a registry over plain HTTP")
	var out string
	export := &cobra.Command{
		Use: "export NAME", Short: "Write a template as a `docker save` tarball (-o FILE, or standard output)", Args: cobra.ExactArgs(1),
		PreRunE: func(cmd *cobra.Command, _ []string) error {
			// The tarball holds the image's files, bytes its author
			// chose: on the operator's terminal they are escape
			// sequences (its clipboard, its title, answers typed back).
			if (out == "" || out == "-") && isTerminal(cmd.OutOrStdout()) {
				return exitf(ExitUsage, "template export: standard output is a terminal; refusing to write a tarball there (use -o FILE or redirect it)")
			}
			return nil
		},
		RunE: withStore(func(cmd *cobra.Command, st *imgstore.Store, args []string) error {
			if _, err := st.Get(args[0]); err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			if out != "" && out != "-" {
				// A new file of its own beside out (O_EXCL, a name no one
				// can guess), renamed over out: the destination's
				// directory may be another user's to write (/tmp), and a
				// fixed name there (out.partial) was opened through the
				// link such a user planted, root's file overwritten.
				f, err := os.CreateTemp(filepath.Dir(out), "."+filepath.Base(out)+".partial-*")
				if err != nil {
					return exitf(ExitUsage, "%v", err)
				}
				if err := st.Export(ctxOf(cmd), args[0], f); err != nil {
					f.Close()
					os.Remove(f.Name())
					return err
				}
				err = f.Chmod(0o644 &^ umask())
				if cerr := f.Close(); err == nil {
					err = cerr
				}
				if err != nil {
					os.Remove(f.Name())
					return err
				}
				return os.Rename(f.Name(), out)
			}
			return st.Export(ctxOf(cmd), args[0], w)
		}),
	}
	export.Flags().StringVarP(&out, "output", "o", "", "file to write (default: standard output)")
	gc := &cobra.Command{
		Use: "gc", Short: "Remove unpacked layers no template uses", Args: cobra.NoArgs,
		RunE: withStore(func(cmd *cobra.Command, st *imgstore.Store, _ []string) error {
			removed, err := st.GC()
			for _, l := range removed {
				fmt.Fprintln(cmd.OutOrStdout(), l)
			}
			return err
		}),
	}
	build := newTemplateBuildCmd(g, &data)
	for _, c := range []*cobra.Command{ls, inspect} {
		c.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	}
	cmd.AddCommand(ls, inspect, rm, imp, pull, export, gc, build)
	return cmd
}

func ctxOf(cmd *cobra.Command) context.Context {
	if ctx := cmd.Context(); ctx != nil {
		return ctx
	}
	return context.Background()
}

// isTerminal says whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

func shortID(id string) string {
	id = strings.TrimPrefix(id, "sha256:")
	return id[:min(12, len(id))]
}

func printImported(w io.Writer, t *imgstore.Template) error {
	_, err := fmt.Fprintf(w, "%s %s (%d layers, %s)\n", t.Name, shortID(t.ID), len(t.Layers), units.HumanSize(t.Size))
	return err
}

// newTemplateBuildCmd is `cage template build`.
func newTemplateBuildCmd(g *globals, data *string) *cobra.Command {
	var file, netMode, mirror string
	var buildArgs []string
	var noCache bool
	stepTimeout := build.DefaultStepTimeout
	cmd := &cobra.Command{
		Use:   "build [flags] CONTEXT NAME",
		Short: "Build a template from a Dockerfile (RUN steps run in cage sandboxes, cached per step)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if os.Geteuid() != 0 {
				return exitf(ExitNoPerm, "cage template build needs root")
			}
			if err := build.CheckStepTimeout(stepTimeout); err != nil {
				return exitf(ExitUsage, "--step-timeout: %v", err)
			}
			st, err := openTemplates(*data)
			if err != nil {
				return err
			}
			host, err := sandbox.NewHost(g.runDir, "", g.log)
			if err != nil {
				return err
			}
			defer host.Close()
			host.Templates = st
			if host.NetConfig.Upstreams, err = network.ParseUpstreams(strings.Split(os.Getenv("CAGE_DNS"), ",")); err != nil {
				return exitf(ExitUsage, "CAGE_DNS: %v", err)
			}
			b := &build.Builder{Host: host, Context: args[0], Args: map[string]string{}, NoCache: noCache,
				Out: cmd.ErrOrStderr(), Mirror: mirror, StepTimeout: stepTimeout}
			if f, ok := cmd.ErrOrStderr().(*os.File); ok {
				b.TTY = term.IsTerminal(int(f.Fd()))
			}
			switch netMode {
			case "", "none":
			case "internet":
				b.Net = network.Policy{Mode: network.Internet}
			default:
				return exitf(ExitUsage, "--net %q: want none or internet", netMode)
			}
			for _, kv := range buildArgs {
				k, v, ok := strings.Cut(kv, "=")
				if !ok || k == "" {
					return exitf(ExitUsage, "--build-arg %q: want NAME=VALUE", kv)
				}
				b.Args[k] = v
			}
			if fi, err := os.Stat(args[0]); err != nil || !fi.IsDir() {
				return exitf(ExitUsage, "build context %s: not a directory", args[0])
			}
			df, file, err := openDockerfile(args[0], file)
			if err != nil {
				return exitf(ExitUsage, "%v", err)
			}
			defer df.Close()
			abs, _ := filepath.Abs(file)
			// An interrupt stops the build, which destroys its step's
			// sandbox and removes what it staged on the way out.
			ctx, stop := signal.NotifyContext(ctxOf(cmd), syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
			defer stop()
			go func() { <-ctx.Done(); stop() }() // a second interrupt ends cage at once
			t, err := b.Build(ctx, df, args[1], "dockerfile:"+abs)
			switch {
			case err == nil:
			case ctx.Err() != nil && ctxOf(cmd).Err() == nil:
				return exitf(128+int(syscall.SIGINT), "interrupted; the build stopped and its step's sandbox was destroyed")
			case errors.Is(err, build.ErrFailed):
				return exitf(1, "build failed: %v", err)
			case errors.Is(err, build.ErrNoMmdebstrap):
				return exitf(ExitUnavailable, "%v", err)
			default:
				return templateErr(err)
			}
			return printImported(cmd.OutOrStdout(), t)
		},
	}
	fl := cmd.Flags()
	fl.StringVarP(&file, "file", "f", "", "the Dockerfile (default CONTEXT/Dockerfile)")
	fl.StringVar(&netMode, "net", "none", "network of the RUN steps: none, or internet (the build says so at each step)")
	fl.StringArrayVar(&buildArgs, "build-arg", nil, "NAME=VALUE for an ARG (repeatable)")
	fl.BoolVar(&noCache, "no-cache", false, "run every step again")
	fl.DurationVar(&stepTimeout, "step-timeout", build.DefaultStepTimeout,
		"the most each RUN step may run (its sandbox is then destroyed and the build fails); at most "+build.MaxStepTimeout.String())
	fl.StringVar(&mirror, "mirror", "", "Debian mirror for FROM debian:bookworm (default "+build.DefaultMirror+")")
	return cmd
}

// openDockerfile opens the build's Dockerfile, file or else the context's
// own, and returns it with its path. The context may be another user's
// checkout, read as root: its Dockerfile is opened through the context (a
// link out of it, to a file only root may read, is refused rather than
// read and quoted in a parse error), and either is opened without blocking
// and used only if what was opened is a regular file (a FIFO held root's
// build at its open for good).
func openDockerfile(ctxDir, file string) (*os.File, string, error) {
	var f *os.File
	var err error
	if file == "" {
		file = filepath.Join(ctxDir, "Dockerfile")
		var root *os.Root
		if root, err = os.OpenRoot(ctxDir); err == nil {
			f, err = root.OpenFile("Dockerfile", os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
			root.Close()
		}
		if err != nil && !errors.Is(err, os.ErrNotExist) && !errors.Is(err, os.ErrPermission) {
			return nil, "", fmt.Errorf("%s: not a file of the build context (%v)", file, errors.Unwrap(err))
		}
	} else {
		f, err = os.OpenFile(file, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	}
	if err != nil {
		return nil, "", fmt.Errorf("%s: %v", file, errors.Unwrap(err))
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, "", fmt.Errorf("%s: not a regular file", file)
	}
	return f, file, nil
}
