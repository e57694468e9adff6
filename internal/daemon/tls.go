package daemon

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"

	"github.com/cagehq/cage/internal/proxy"
)

// TLS configures the proxy's listener to speak TLS (only TLS: a plain
// request there gets a 400), with the operator's certificate for the
// sandbox domain, or one cage signs with a CA of its own kept in DATA/tls
// (SelfSigned; its certificate is printed at the start, for users to trust).
type TLS struct {
	Cert       string `json:"cert"` // PEM: the certificate (chain) for the domain and *.domain
	Key        string `json:"key"`  // PEM: its key, readable by its owner only
	SelfSigned bool   `json:"self_signed"`
}

func (t TLS) on() bool { return t.Cert != "" || t.Key != "" || t.SelfSigned }

func (t TLS) options(cfg Config) proxy.TLSOptions {
	return proxy.TLSOptions{CertFile: t.Cert, KeyFile: t.Key, SelfSigned: t.SelfSigned,
		Dir: filepath.Join(cfg.Data, "tls"), Domain: cfg.Domain}
}

// CheckTLS says what is wrong with cfg's TLS settings, writing nothing
// (cage serve reports it as a usage error before it starts).
func CheckTLS(cfg Config) error {
	if !cfg.TLS.on() {
		return nil
	}
	return proxy.CheckTLSOptions(cfg.TLS.options(cfg))
}

// serve sets up srv to serve TLS when configured, and says so.
func (t TLS) serve(srv *http.Server, cfg Config, log *slog.Logger) error {
	if !t.on() {
		return nil
	}
	c, err := proxy.NewTLS(t.options(cfg))
	if err != nil {
		return err
	}
	c.Config.NextProtos = []string{"h2", "http/1.1"}
	srv.TLSConfig = c.Config
	srv.Protocols.SetHTTP2(true)
	if c.CAFile != "" {
		pem, err := os.ReadFile(c.CAFile)
		if err != nil {
			return err
		}
		log.Info("cage serve: the proxy's TLS certificate is signed by cage's local CA: trust it (its key stays in the data directory)",
			"ca", c.CAFile, "spki_sha256", c.CASPKI, "domain", cfg.Domain)
		fmt.Fprintf(os.Stderr, "cage serve: https://{port}-{sandbox}.%s: trust this CA (%s; Chromium: --ignore-certificate-errors-spki-list=%s):\n%s",
			cfg.Domain, c.CAFile, c.CASPKI, pem)
	} else {
		log.Info("cage serve: the proxy serves TLS", "cert", t.Cert, "domain", cfg.Domain)
	}
	return nil
}

// serveProxy serves srv on l, over TLS where srv has a TLS configuration.
func serveProxy(srv *http.Server, l net.Listener) error {
	if srv.TLSConfig == nil {
		return srv.Serve(l)
	}
	return srv.Serve(tls.NewListener(l, srv.TLSConfig))
}
