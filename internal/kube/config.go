package kube

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"sigs.k8s.io/yaml"
)

// Config is where the API server is and who the client is: what a
// kubeconfig's current context names.
type Config struct {
	Server             string
	CAData             []byte // PEM; none: the system's roots
	InsecureSkipVerify bool
	ServerName         string // TLS server name (tls-server-name)
	Token, TokenFile   string
	CertData, KeyData  []byte // PEM client certificate and key
}

// kubeconfig is the part of a kubeconfig file cage reads; the fields it
// cannot honour are read only to be refused by name.
type kubeconfig struct {
	CurrentContext string `json:"current-context"`
	Clusters       []struct {
		Name    string `json:"name"`
		Cluster struct {
			Server     string `json:"server"`
			CA         string `json:"certificate-authority"`
			CAData     []byte `json:"certificate-authority-data"`
			Insecure   bool   `json:"insecure-skip-tls-verify"`
			ServerName string `json:"tls-server-name"`
			ProxyURL   string `json:"proxy-url"`
		} `json:"cluster"`
	} `json:"clusters"`
	Users []struct {
		Name string `json:"name"`
		User struct {
			Token        string         `json:"token"`
			TokenFile    string         `json:"tokenFile"`
			Cert         string         `json:"client-certificate"`
			CertData     []byte         `json:"client-certificate-data"`
			Key          string         `json:"client-key"`
			KeyData      []byte         `json:"client-key-data"`
			Exec         map[string]any `json:"exec"`
			AuthProvider map[string]any `json:"auth-provider"`
			Username     string         `json:"username"`
			Password     string         `json:"password"`
			As           string         `json:"as"`
		} `json:"user"`
	} `json:"users"`
	Contexts []struct {
		Name    string `json:"name"`
		Context struct {
			Cluster string `json:"cluster"`
			User    string `json:"user"`
		} `json:"context"`
	} `json:"contexts"`
}

// LoadKubeconfig reads the kubeconfig file at path: its current
// context's cluster and user. What cage cannot do (exec and
// auth-provider plugins, basic auth, impersonation, a proxy URL) is a
// one-line error naming the field.
func LoadKubeconfig(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var kc kubeconfig
	if err := yaml.Unmarshal(b, &kc); err != nil {
		return nil, fmt.Errorf("not a kubeconfig: %v", oneLine(err.Error()))
	}
	dir := filepath.Dir(path)
	rel := func(p string) string {
		if p == "" || filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(dir, p)
	}
	if kc.CurrentContext == "" {
		return nil, errors.New("no current-context")
	}
	var clusterName, userName string
	found := false
	for _, c := range kc.Contexts {
		if c.Name == kc.CurrentContext {
			clusterName, userName, found = c.Context.Cluster, c.Context.User, true
		}
	}
	if !found {
		return nil, fmt.Errorf("current-context %q is not among its contexts", kc.CurrentContext)
	}
	cfg := &Config{}
	found = false
	for _, c := range kc.Clusters {
		if c.Name != clusterName {
			continue
		}
		found = true
		cl := c.Cluster
		if cl.ProxyURL != "" {
			return nil, fmt.Errorf("cluster %q: proxy-url is not supported by cage", clusterName)
		}
		cfg.Server, cfg.InsecureSkipVerify, cfg.ServerName, cfg.CAData = cl.Server, cl.Insecure, cl.ServerName, cl.CAData
		if cfg.CAData == nil && cl.CA != "" {
			if cfg.CAData, err = os.ReadFile(rel(cl.CA)); err != nil {
				return nil, fmt.Errorf("cluster %q: certificate-authority: %w", clusterName, err)
			}
		}
	}
	if !found {
		return nil, fmt.Errorf("context %q names cluster %q, which it does not have", kc.CurrentContext, clusterName)
	}
	if cfg.Server == "" {
		return nil, fmt.Errorf("cluster %q has no server", clusterName)
	}
	for _, u := range kc.Users {
		if u.Name != userName {
			continue
		}
		us := u.User
		switch {
		case us.Exec != nil:
			return nil, fmt.Errorf("user %q: exec (a credential plugin) is not supported by cage; use a token or a client certificate", userName)
		case us.AuthProvider != nil:
			return nil, fmt.Errorf("user %q: auth-provider is not supported by cage; use a token or a client certificate", userName)
		case us.Username != "" || us.Password != "":
			return nil, fmt.Errorf("user %q: username/password (basic auth) is not supported by cage; use a token or a client certificate", userName)
		case us.As != "":
			return nil, fmt.Errorf("user %q: as (impersonation) is not supported by cage", userName)
		}
		cfg.Token, cfg.TokenFile = us.Token, rel(us.TokenFile)
		cfg.CertData, cfg.KeyData = us.CertData, us.KeyData
		if cfg.CertData == nil && us.Cert != "" {
			if cfg.CertData, err = os.ReadFile(rel(us.Cert)); err != nil {
				return nil, fmt.Errorf("user %q: client-certificate: %w", userName, err)
			}
		}
		if cfg.KeyData == nil && us.Key != "" {
			if cfg.KeyData, err = os.ReadFile(rel(us.Key)); err != nil {
				return nil, fmt.Errorf("user %q: client-key: %w", userName, err)
			}
		}
		if (cfg.CertData == nil) != (cfg.KeyData == nil) {
			return nil, fmt.Errorf("user %q: a client certificate needs its key and a key its certificate", userName)
		}
	}
	if cfg.Token != "" && cfg.TokenFile != "" {
		cfg.TokenFile = "" // as client-go: the token wins
	}
	return cfg, nil
}

// tlsConfig is the TLS configuration of cfg.
func (cfg *Config) tlsConfig() (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: cfg.InsecureSkipVerify, ServerName: cfg.ServerName}
	if len(cfg.CAData) > 0 {
		if cfg.InsecureSkipVerify {
			return nil, errors.New("kube: certificate-authority and insecure-skip-tls-verify both set")
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(cfg.CAData) {
			return nil, errors.New("kube: certificate-authority: no PEM certificate in it")
		}
		tc.RootCAs = pool
	}
	if cfg.CertData != nil {
		cert, err := tls.X509KeyPair(cfg.CertData, cfg.KeyData)
		if err != nil {
			return nil, fmt.Errorf("kube: client certificate: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

func oneLine(s string) string {
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			return s[:i]
		}
	}
	return s
}
